"""Prefix-aware routing vs round robin over N `kestrel serve` replicas (the llm-d comparison), on one host.

Workload (llm-d-benchmark's shared-prefix multi-turn shape): G groups, each with a long shared system prompt;
U users per group, each holding a T-turn conversation whose history grows with every answer. All conversations
run at once; each user sends its next turn when the previous answer has streamed in. The same replicas serve both
policies, one after the other, each phase with fresh documents so neither inherits the other's cache. Replica KV
caches are sized so one replica cannot hold every group's prefix (as in a real fleet): round robin spreads every
group over every replica and thrashes, prefix-aware routing keeps each group where its prefix is.

    python bench/routing.py                    # 4 replicas, CPU, embedded SmolLM2
    python bench/routing.py --replicas 2 --groups 4 --turns 3   # smaller

Prints TTFT p50/p99, request and token throughput per policy, replica prefix-cache hit rates, and the ratios
(llm-d's published anchor: ~2x better TTFT, ~3x throughput).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kestrel.router import launch  # noqa: E402
from kestrel.router.replica import parse_metrics  # noqa: E402

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda sigma omega river stone cloud "
         "forest signal engine harbor lantern meadow copper violet summit").split()


def document(tag: str, g: int, chars: int) -> str:
    out, i = [f"You are assistant {tag}-{g}. Reference notes:"], 0
    while sum(len(s) + 1 for s in out) < chars:
        out.append(f"Note {i}: the {WORDS[(g * 7 + i) % len(WORDS)]} of group {g} is "
                   f"{WORDS[(g + i * 3) % len(WORDS)]} {i * (g + 1)}.")
        i += 1
    return " ".join(out)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def conversation(client: httpx.AsyncClient, url: str, doc: str, user: int, turns: int, max_tokens: int,
                       rec: list):
    messages = [{"role": "system", "content": doc}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"User {user}, question {t}: summarise note {t + user}."})
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        t0 = time.perf_counter()
        ttft, text, ntok = None, [], 0
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                delta = chunk["choices"][0].get("delta", {}).get("content")
                if delta:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(delta)
                    ntok += 1
        rec.append({"ttft": ttft, "latency": time.perf_counter() - t0, "tokens": ntok,
                    "replica": resp.headers.get("x-kestrel-replica")})
        messages.append({"role": "assistant", "content": "".join(text)})


async def phase(router_url: str, tag: str, args) -> dict:
    rec: list[dict] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(client, router_url, document(tag, g, args.doc_chars), u, args.turns,
                                            args.max_tokens, rec)
                               for g in range(args.groups) for u in range(args.users)))
        wall = time.perf_counter() - t0
    ttfts = [r["ttft"] for r in rec if r["ttft"] is not None]
    return {"requests": len(rec), "wall_s": wall, "ttft_p50_s": pct(ttfts, 0.5), "ttft_p99_s": pct(ttfts, 0.99),
            "ttft_mean_s": statistics.mean(ttfts), "req_per_s": len(rec) / wall,
            "out_tok_per_s": sum(r["tokens"] for r in rec) / wall}


def counters(reps) -> tuple[float, float]:
    m = [parse_metrics(httpx.get(r.url + "/metrics", timeout=30).text) for r in reps]
    return sum(x.get("prefix_hits", 0) for x in m), sum(x.get("prefix_queries", 0) for x in m)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=4, help="kestrel serve replicas to start (default 4)")
    p.add_argument("--groups", type=int, default=8, help="groups sharing one system prompt (default 8)")
    p.add_argument("--users", type=int, default=2, help="users (conversations) per group (default 2)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    p.add_argument("--doc-chars", type=int, default=1200, help="shared system prompt length in characters")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per turn (default 8)")
    p.add_argument("--kv-cache-gb", type=float, default=0.06,
                   help="KV cache per replica (default 0.06 GB ~ 1400 tokens of SmolLM2: two groups, not all)")
    p.add_argument("--max-inflight-per-replica", type=int, default=4, help="router's per-replica limit")
    p.add_argument("--rounds", type=int, default=1, help="repeat both phases, alternating order (default 1)")
    p.add_argument("--json", default=None, help="also write the raw numbers here")
    args = p.parse_args()

    logdir = tempfile.mkdtemp(prefix="kestrel-routing-")
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    serve = ("--max-model-len", "1024", "--kv-cache-gb", str(args.kv_cache_gb), "--max-num-seqs", "8",
             "--log-level", "warning")
    procs = []
    try:
        print(f"starting {args.replicas} replicas (logs in {logdir}) ...", flush=True)
        reps = [launch.kestrel_serve(launch.free_port(), *serve, log_path=f"{logdir}/replica{i}.log", env=env)
                for i in range(args.replicas)]
        procs += reps
        for r in reps:
            r.wait_healthy(900)
        routers = {}
        for policy in ("score", "round_robin"):
            rt = launch.router(launch.free_port(), [r.url for r in reps], "--policy", policy,
                               "--max-inflight-per-replica", str(args.max_inflight_per_replica),
                               "--read-timeout", "600", "--queue-timeout", "600",
                               log_path=f"{logdir}/router-{policy}.log")
            procs.append(rt)
            routers[policy] = rt.wait_healthy(60)
        results = {"score": [], "round_robin": []}
        for rnd in range(args.rounds):
            order = ("round_robin", "score") if rnd % 2 == 0 else ("score", "round_robin")
            for policy in order:
                h0, q0 = counters(reps)
                res = asyncio.run(phase(routers[policy].url, f"{policy}{rnd}", args))
                h1, q1 = counters(reps)
                res["prefix_hit_rate"] = (h1 - h0) / max(1.0, q1 - q0)
                results[policy].append(res)
                print(f"round {rnd} {policy:12s} " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else
                                                            f"{k}={v}" for k, v in res.items()), flush=True)
    finally:
        for pr in procs:
            pr.stop()

    def avg(policy, key):
        return statistics.mean(r[key] for r in results[policy])

    print("\nworkload: " + json.dumps(vars(args)))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}")
    print(f"{'policy':12s} {'TTFT p50 s':>10s} {'TTFT p99 s':>10s} {'req/s':>8s} {'out tok/s':>10s} {'hit rate':>9s}")
    for policy in ("round_robin", "score"):
        print(f"{policy:12s} {avg(policy, 'ttft_p50_s'):10.3f} {avg(policy, 'ttft_p99_s'):10.3f} "
              f"{avg(policy, 'req_per_s'):8.3f} {avg(policy, 'out_tok_per_s'):10.2f} "
              f"{avg(policy, 'prefix_hit_rate'):9.3f}")
    ratios = {"ttft_p50 (rr/aware)": avg("round_robin", "ttft_p50_s") / avg("score", "ttft_p50_s"),
              "ttft_p99 (rr/aware)": avg("round_robin", "ttft_p99_s") / avg("score", "ttft_p99_s"),
              "throughput (aware/rr)": avg("score", "req_per_s") / avg("round_robin", "req_per_s")}
    print("ratios (llm-d anchor: ~2x TTFT, ~3x throughput): " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "ratios": ratios}, f, indent=1)


if __name__ == "__main__":
    main()
