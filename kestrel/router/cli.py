"""`kestrel router`: run the gateway in front of replicas started with `kestrel serve`."""
from __future__ import annotations

import argparse
import sys

from kestrel.router.config import RouterConfig
from kestrel.router.scorers import parse_weights


def _pairs(items: list[str], flag: str, convert=str) -> dict:
    out = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise ValueError(f"{flag} expects KEY=VALUE, got {item!r}")
        try:
            out[k] = convert(v)
        except ValueError:
            raise ValueError(f"{flag} {item!r}: {v!r} is not a number") from None
    return out


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "router", help="OpenAI-compatible gateway over many replicas (prefix-aware routing, tenant QoS)",
        description="Route OpenAI API requests to `kestrel serve` replicas. Each request waits in a weighted fair "
                    "queue (per tenant, interactive before batch) for a replica slot, then goes to the replica with "
                    "the best weighted score (prefix-cache affinity, queue depth, KV use, predicted latency).")
    p.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="replica base URL, e.g. http://127.0.0.1:8001 (repeat for each replica)")
    p.add_argument("--prefill-replica", action="append", default=[], metavar="URL",
                   help="P/D disaggregation: a replica that computes prompt KV (repeatable; needs --decode-replica)")
    p.add_argument("--decode-replica", action="append", default=[], metavar="URL",
                   help="P/D disaggregation: a replica that decodes from handed-over KV (repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    p.add_argument("--policy", choices=["score", "round_robin"], default="score",
                   help="routing policy: weighted scorers (default) or plain round robin (baseline)")
    p.add_argument("--weights", default=None, metavar="NAME=W,...",
                   help="scorer weights, e.g. prefix=3,queue=2,kv=1,latency=1 (the default); unnamed scorers get 0")
    p.add_argument("--qos", choices=["wfq", "fifo"], default="wfq",
                   help="queueing between tenants: weighted fair queueing (default) or arrival order")
    p.add_argument("--tenant-weight", action="append", default=[], metavar="TENANT=W",
                   help="share of a tenant in fair queueing (default 1 for every tenant; repeatable)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY=TENANT",
                   help="map a bearer API key to a tenant name (otherwise the X-Tenant header, or a hash of the key)")
    p.add_argument("--max-inflight-per-replica", type=int, default=4,
                   help="requests the router lets run on one replica at once; the rest wait in the fair queue "
                        "(default 4)")
    p.add_argument("--max-queued-per-tenant", type=int, default=1000,
                   help="queued requests per tenant before new ones get HTTP 503 (default 1000)")
    p.add_argument("--queue-timeout", type=float, default=120.0,
                   help="seconds a request may wait for a replica slot before HTTP 503 (default 120)")
    p.add_argument("--read-timeout", type=float, default=120.0,
                   help="seconds of silence from a replica before it counts as failed (default 120)")
    p.add_argument("--connect-timeout", type=float, default=2.0, help="replica connect timeout in seconds (default 2)")
    p.add_argument("--health-interval", type=float, default=1.0,
                   help="seconds between /health and /metrics polls of each replica (default 1)")
    p.add_argument("--max-attempts", type=int, default=3,
                   help="replicas tried for a request that has not started streaming (default 3)")
    p.add_argument("--prefix-chunk-chars", type=int, default=64,
                   help="characters per hashed prompt chunk in the router's prefix index (default 64 ~ 16 tokens)")
    p.add_argument("--k8s-selector", default=None, metavar="LABELS",
                   help="inside Kubernetes: discover replicas as Ready pods matching this label selector")
    p.add_argument("--k8s-namespace", default=None, help="namespace for discovery (default: the router pod's own)")
    p.add_argument("--k8s-port", type=int, default=8000, help="replica port for discovered pods (default 8000)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log level (default info)")
    p.set_defaults(func=run)
    return p


def build_config(args) -> RouterConfig:
    cfg = RouterConfig(
        replicas=args.replica, prefill_replicas=args.prefill_replica, decode_replicas=args.decode_replica,
        policy=args.policy, weights=parse_weights(args.weights), qos=args.qos,
        tenant_weights=_pairs(args.tenant_weight, "--tenant-weight", float),
        api_keys=_pairs(args.api_key, "--api-key"), max_inflight_per_replica=args.max_inflight_per_replica,
        max_queued_per_tenant=args.max_queued_per_tenant, queue_timeout_s=args.queue_timeout,
        read_timeout_s=args.read_timeout, connect_timeout_s=args.connect_timeout,
        health_interval_s=args.health_interval, max_attempts=args.max_attempts,
        prefix_chunk_chars=args.prefix_chunk_chars, k8s_selector=args.k8s_selector,
        k8s_namespace=args.k8s_namespace, k8s_port=args.k8s_port)
    cfg.validate()
    return cfg


def run(args) -> int:
    try:
        cfg = build_config(args)
    except ValueError as e:
        print(f"kestrel router: error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from kestrel.router.gateway import create_app
    uvicorn.run(create_app(cfg), host=args.host, port=args.port, log_level=args.log_level)
    return 0


def main(argv=None) -> int:
    """Standalone entry (python -m kestrel.router.cli) for when the top-level CLI is not there."""
    parser = argparse.ArgumentParser(prog="kestrel")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
