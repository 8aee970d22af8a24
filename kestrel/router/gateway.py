"""The router: an OpenAI-compatible gateway in front of many `kestrel serve` replicas.

A request is tagged with its tenant and priority class, waits in the fair queue for a replica slot, is routed by
the weighted scorers, and is proxied with httpx; streamed responses pass through event by event, byte for byte.
Failures: a request that has not yet sent anything to the client is retried on another replica (the failed one is
marked down until its health probe passes again); a stream that already started ends with an SSE error event and
[DONE]. Every upstream wait has a timeout, so nothing hangs.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kestrel.router.config import RouterConfig
from kestrel.router.prefix_index import PrefixIndex
from kestrel.router.qos import PRIORITY_CLASSES, FairScheduler, QueueTimeout, Ticket, priority_of, tenant_of
from kestrel.router.replica import Replica, parse_metrics
from kestrel.router.scorers import Picker

log = logging.getLogger("kestrel.router")

_FORWARD_HEADERS = ("authorization", "content-type", "accept", "x-request-id")


def error_json(message: str, status: int, type: str = "router_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type, "param": None, "code": status}},
                        status_code=status)


def sse_error(message: str) -> bytes:
    body = {"error": {"message": message, "type": "upstream_error", "param": None, "code": 502}}
    return b"data: " + json.dumps(body).encode() + b"\n\n" + b"data: [DONE]\n\n"


def prompt_text(body: dict) -> str:
    """The text the prefix index hashes: chat messages in order (role + content), or the completion prompt."""
    if isinstance(body.get("messages"), list):
        parts = []
        for m in body["messages"]:
            if not isinstance(m, dict):
                continue
            c = m.get("content")
            if isinstance(c, list):
                c = "".join(p.get("text", "") for p in c if isinstance(p, dict))
            parts.append(f"<{m.get('role', '')}>{c or ''}")
        return "".join(parts)
    p = body.get("prompt")
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
        return " ".join(map(str, p)) + " "  # token ids: chunk boundaries still line up with equal prefixes
    if isinstance(p, list) and p and isinstance(p[0], str):
        return p[0]
    return ""


class UpstreamFailed(Exception):
    pass


async def sse_events(resp: httpx.Response) -> AsyncIterator[bytes]:
    """Whole SSE events (each ending in a blank line), as the replica sent them; raises if the body is cut."""
    buf = b""
    async for chunk in resp.aiter_bytes():
        buf += chunk.replace(b"\r\n", b"\n")
        while True:
            end = buf.find(b"\n\n")
            if end < 0:
                break
            yield buf[:end + 2]
            buf = buf[end + 2:]
    if buf.strip():
        raise UpstreamFailed("replica closed the stream in the middle of an event")


class Router:
    def __init__(self, cfg: RouterConfig):
        cfg.validate()
        self.cfg = cfg
        self.replicas: dict[str, Replica] = {}
        for url in cfg.replicas:
            self.add_replica(url)
        for url in cfg.prefill_replicas:
            self.add_replica(url, "prefill")
        for url in cfg.decode_replicas:
            self.add_replica(url, "decode")
        self.index = PrefixIndex(cfg.prefix_chunk_chars, cfg.prefix_index_entries)
        self.picker = Picker(self.index, cfg.weights, cfg.policy)
        self.scheduler = FairScheduler(lambda: list(self.replicas.values()), cfg.max_inflight_per_replica,
                                       cfg.tenant_weights, cfg.qos, cfg.queue_timeout_s, cfg.max_queued_per_tenant)
        # with P/D disaggregation requests are served by decode replicas after a prefill replica's KV hand-over
        self.serve_role = "decode" if cfg.decode_replicas else "both"
        self.client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task] = []
        self._init_metrics()

    # ---- replicas -------------------------------------------------------------------------------------------
    def add_replica(self, url: str, role: str = "both") -> Replica:
        r = Replica(url, role)
        return self.replicas.setdefault(r.url, r)

    def remove_replica(self, url: str) -> None:
        self.replicas.pop(url.rstrip("/"), None)

    def _replica_failed(self, r: Replica, reason: str, lost_cache: bool = True) -> None:
        log.warning("replica %s marked down: %s", r.url, reason)
        r.stats["failed"] += 1
        r.mark_down(reason)
        if lost_cache:  # the process went away: when it comes back its cache is cold
            self.index.forget_replica(r.url)

    @staticmethod
    def _process_gone(e: BaseException) -> bool:
        """Refused connection or a peer that vanished mid-response (vs. a slow but living replica)."""
        return isinstance(e, (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, UpstreamFailed))

    async def _probe(self, r: Replica) -> None:
        try:
            resp = await self.client.get(r.url + "/health", timeout=self.cfg.probe_timeout_s)
            ok, gone, why = resp.status_code == 200, False, f"/health answered HTTP {resp.status_code}"
        except httpx.HTTPError as e:
            ok, gone, why = False, self._process_gone(e), f"/health: {type(e).__name__}: {e}"
        if not ok:
            # a busy replica may answer slowly: only a dead one (refused) is marked down at the first failure
            r.probe_failures += 1
            if r.healthy and (gone or r.probe_failures >= self.cfg.probe_failures_down):
                self._replica_failed(r, why, lost_cache=gone)
            return
        r.probe_failures = 0
        was_down = not r.healthy
        r.mark_up()
        try:
            m = await self.client.get(r.url + "/metrics", timeout=self.cfg.probe_timeout_s)
            if m.status_code == 200:
                r.update_metrics(parse_metrics(m.text))
        except (httpx.HTTPError, ValueError):
            pass  # load numbers are advisory; health is what matters
        if was_down:
            self.scheduler.pump()

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(r) for r in list(self.replicas.values())))
            self._m_healthy.set(sum(r.healthy for r in self.replicas.values()))
            await asyncio.sleep(self.cfg.health_interval_s)

    async def start(self) -> None:
        t = self.cfg
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(t.read_timeout_s, connect=t.connect_timeout_s),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self._tasks.append(asyncio.create_task(self._poll_loop()))
        if t.k8s_selector:
            from kestrel.router.discovery import k8s_discovery_loop
            self._tasks.append(asyncio.create_task(k8s_discovery_loop(self)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.client is not None:
            await self.client.aclose()

    # ---- metrics --------------------------------------------------------------------------------------------
    def _init_metrics(self) -> None:
        r = self.registry = CollectorRegistry()
        self._m_requests = Counter("kestrel_router_requests", "Requests by tenant, priority and outcome",
                                   ["tenant", "priority", "outcome"], registry=r)
        self._m_wait = Histogram("kestrel_router_queue_wait_seconds", "Time waiting in the router's fair queue",
                                 ["tenant", "priority"], registry=r,
                                 buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self._m_retries = Counter("kestrel_router_retries", "Requests retried on another replica", registry=r)
        self._m_healthy = Gauge("kestrel_router_healthy_replicas", "Replicas passing health checks", registry=r)
        self._m_queued = Gauge("kestrel_router_queued_requests", "Requests waiting for a replica slot", registry=r)
        self._m_queued.set_function(self.scheduler.queue_len)
        self._m_pd = Counter("kestrel_router_prefill_legs", "P/D prefill legs by outcome", ["outcome"], registry=r)
        self._m_prefix = Counter("kestrel_router_prefix_matched_chunks",
                                 "Prompt chunks the chosen replica was believed to hold", registry=r)

    # ---- request path ---------------------------------------------------------------------------------------
    def _chooser(self, hashes: list[bytes], avoid: set[str], role: str = "both"):
        def choose(free: list[Replica]) -> Replica | None:
            pool = [r for r in free if r.role == role]
            pool = [r for r in pool if r.url not in avoid] or pool
            if not pool:
                return None
            ctx = self.picker.context(hashes, pool)
            r = self.picker.pick(ctx, pool)
            self._m_prefix.inc(ctx.prefix_matches.get(r.url, 0))
            self.index.insert(hashes, r.url)  # it will hold this prefix once the request is prefilled
            return r
        return choose

    async def _acquire(self, req: dict, avoid: set[str], role: str | None = None) -> tuple[Replica, Ticket]:
        role = role or self.serve_role
        if not any(r.healthy and r.role == role for r in self.replicas.values()):
            raise QueueTimeout("no healthy replica")
        t = Ticket(req["tenant"], req["priority"], req["cost"], self._chooser(req["hashes"], avoid, role))
        r = await self.scheduler.acquire(t)
        r.stats["dispatched"] += 1
        self._m_wait.labels(t.tenant, t.priority).observe(t.queue_wait)
        return r, t

    async def _prefill_leg(self, req: dict, decode: Replica) -> None:
        """P/D: a prefill replica computes the prompt's KV and pushes it to `decode` (replica to replica); if that
        fails the decode replica simply computes the prompt itself, so this never fails the request."""
        try:
            p, t = await self._acquire(req, set(), role="prefill")
        except QueueTimeout as e:
            req["pd"] = {"error": str(e)}
            return
        try:
            kind = "chat" if "chat" in req["path"] else "completion"
            resp = await self.client.post(p.url + "/kv/prefill", headers=req["headers"],
                                          json={"kind": kind, "request": req["body"], "target": decode.url})
            if resp.status_code == 200:
                req["pd"] = {"prefill": p.url, **resp.json()}
                self._m_pd.labels("ok").inc()
            else:
                req["pd"] = {"prefill": p.url, "error": f"HTTP {resp.status_code}: {resp.text[:200]}"}
                self._m_pd.labels("refused").inc()
        except httpx.HTTPError as e:
            self._replica_failed(p, f"{type(e).__name__}: {e}", lost_cache=self._process_gone(e))
            req["pd"] = {"prefill": p.url, "error": str(e)}
            self._m_pd.labels("failed").inc()
        finally:
            self.scheduler.release(p)

    def _route_headers(self, r: Replica, t: Ticket, req: dict) -> dict:
        pd = req.get("pd")
        if pd is not None:
            extra = {"x-kestrel-prefill-replica": pd.get("prefill", ""),
                     "x-kestrel-kv-blocks": str(pd.get("imported", 0))}
            if "error" in pd:
                extra["x-kestrel-prefill-error"] = pd["error"][:200].replace("\n", " ")
        else:
            extra = {}
        return {**extra, "x-kestrel-replica": r.url, "x-kestrel-tenant": t.tenant, "x-kestrel-priority": t.priority,
                "x-kestrel-queue-ms": f"{t.queue_wait * 1000:.1f}", "x-kestrel-arrival-seq": str(t.arrival_seq),
                "x-kestrel-dispatch-seq": str(t.dispatch_seq),
                "x-kestrel-served-while-queued": str(t.dispatch_seq - t.dispatched_before),
                "x-kestrel-attempts": str(req["attempts"])}

    def _done(self, req: dict, outcome: str) -> None:
        self._m_requests.labels(req["tenant"], req["priority"], outcome).inc()

    async def handle(self, request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return error_json(f"request body is not valid JSON: {e}", 400, "invalid_request_error")
        if not isinstance(body, dict):
            return error_json("request body must be a JSON object", 400, "invalid_request_error")
        try:
            priority = priority_of(request.headers, body)
        except ValueError as e:
            return error_json(str(e), 400, "invalid_request_error")
        # the replica's scheduler orders by the same class (lower = sooner), vLLM's convention
        body["priority"] = PRIORITY_CLASSES[priority]
        text = prompt_text(body)
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        req = {"path": path, "body": body, "tenant": tenant_of(request.headers, self.cfg.api_keys),
               "priority": priority, "hashes": self.index.hashes(text), "attempts": 0,
               "cost": len(text) / 4 + (max_tokens if isinstance(max_tokens, int) else 16),
               "headers": {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}}
        if body.get("stream"):
            return await self._stream(req)
        return await self._unary(req)

    async def _unary(self, req: dict) -> Response:
        avoid: set[str] = set()
        last = "no replica tried"
        for _ in range(self.cfg.max_attempts):
            try:
                r, t = await self._acquire(req, avoid)
            except QueueTimeout as e:
                self._done(req, "rejected")
                return error_json(f"{e}; last error: {last}" if avoid else str(e), 503)
            req["attempts"] += 1
            avoid.add(r.url)
            try:
                if r.role == "decode":
                    await self._prefill_leg(req, r)
                resp = await self.client.post(r.url + req["path"], json=req["body"], headers=req["headers"])
            except httpx.HTTPError as e:
                last = f"{r.url}: {type(e).__name__}: {e}"
                self._replica_failed(r, last, lost_cache=self._process_gone(e))
                self._m_retries.inc()
                continue
            finally:
                self.scheduler.release(r)
            if resp.status_code == 503:  # overloaded or shutting down: someone else may take it
                last = f"{r.url}: HTTP 503"
                continue
            self._done(req, "ok" if resp.status_code == 200 else f"http_{resp.status_code}")
            return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"),
                            headers=self._route_headers(r, t, req))
        self._done(req, "failed")
        return error_json(f"all {req['attempts']} attempts failed; last error: {last}", 502)

    async def _open_stream(self, req: dict, avoid: set[str]):
        """Dispatch and wait for the replica's response headers, retrying elsewhere on failure.
        Returns (replica, ticket, response) with the slot held, or an error Response."""
        last = "no replica tried"
        while req["attempts"] < self.cfg.max_attempts:
            try:
                r, t = await self._acquire(req, avoid)
            except QueueTimeout as e:
                return error_json(f"{e}; last error: {last}" if avoid else str(e), 503)
            req["attempts"] += 1
            avoid.add(r.url)
            t.meta["t0"] = time.monotonic()
            try:
                if r.role == "decode":
                    await self._prefill_leg(req, r)
                upstream = self.client.build_request("POST", r.url + req["path"], json=req["body"],
                                                     headers=req["headers"])
                resp = await self.client.send(upstream, stream=True)
            except httpx.HTTPError as e:
                last = f"{r.url}: {type(e).__name__}: {e}"
                self._replica_failed(r, last, lost_cache=self._process_gone(e))
                self.scheduler.release(r)
                self._m_retries.inc()
                continue
            except BaseException:  # cancelled (client gone): hand the slot back
                self.scheduler.release(r)
                raise
            if resp.status_code == 503:
                last = f"{r.url}: HTTP 503"
                await resp.aclose()
                self.scheduler.release(r)
                continue
            return r, t, resp
        return error_json(f"all {req['attempts']} attempts failed; last error: {last}", 502)

    async def _stream(self, req: dict) -> Response:
        avoid: set[str] = set()
        opened = await self._open_stream(req, avoid)
        if isinstance(opened, Response):
            self._done(req, "failed")
            return opened
        r, t, resp = opened
        if resp.status_code != 200:  # a 4xx from the replica is the client's problem: pass it through as is
            try:
                content = await resp.aread()
            finally:
                await resp.aclose()
                self.scheduler.release(r)
            self._done(req, f"http_{resp.status_code}")
            return Response(content, resp.status_code, media_type=resp.headers.get("content-type"),
                            headers=self._route_headers(r, t, req))
        headers = self._route_headers(r, t, req)
        return StreamingResponse(self._relay(req, avoid, r, t, resp), media_type="text/event-stream",
                                 headers={**headers, "cache-control": "no-cache"})

    async def _relay(self, req: dict, avoid: set[str], r: Replica, t: Ticket, resp: httpx.Response):
        forwarded, held, outcome = False, True, "client_disconnected"
        try:
            while True:
                reason, saw_done, gone = "", False, True
                try:
                    async for event in sse_events(resp):
                        if not forwarded:
                            r.observe_ttft(time.monotonic() - t.meta["t0"])
                            forwarded = True
                        saw_done = saw_done or event.strip() == b"data: [DONE]"
                        yield event
                    if not saw_done:
                        reason = "replica closed the stream before [DONE]"
                except (httpx.HTTPError, UpstreamFailed) as e:
                    reason, gone = f"{type(e).__name__}: {e}", self._process_gone(e)
                finally:
                    held = False
                    await resp.aclose()
                    self.scheduler.release(r)
                if not reason:
                    outcome = "ok"
                    return
                self._replica_failed(r, reason, lost_cache=gone)
                if forwarded:
                    outcome = "broken_stream"
                    yield sse_error(f"replica {r.url} failed mid-stream ({reason}); the response is incomplete")
                    return
                self._m_retries.inc()  # nothing reached the client yet: start over on another replica
                opened = await self._open_stream(req, avoid)
                if isinstance(opened, Response):
                    outcome = "failed"
                    yield sse_error(json.loads(opened.body)["error"]["message"])
                    return
                r, t, resp = opened
                held = True
                if resp.status_code != 200:
                    held = False
                    content = (await resp.aread()).decode(errors="replace")
                    await resp.aclose()
                    self.scheduler.release(r)
                    outcome = f"http_{resp.status_code}"
                    yield sse_error(f"replica answered HTTP {resp.status_code}: {content[:500]}")
                    return
        finally:
            if held:  # cancelled (the client went away) while holding the slot
                await resp.aclose()
                self.scheduler.release(r)
            self._done(req, outcome)

    async def forward_get(self, path: str) -> Response:
        for r in [r for r in self.replicas.values() if r.healthy] or list(self.replicas.values()):
            try:
                resp = await self.client.get(r.url + path, timeout=self.cfg.connect_timeout_s * 5)
            except httpx.HTTPError as e:
                self._replica_failed(r, f"{type(e).__name__}: {e}", lost_cache=self._process_gone(e))
                continue
            return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"))
        return error_json("no healthy replica", 503)


def create_app(cfg: RouterConfig) -> FastAPI:
    router = Router(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        yield
        await router.stop()

    app = FastAPI(title="kestrel router", lifespan=lifespan)
    app.state.router = router

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await router.handle(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.handle(request, "/v1/completions")

    @app.get("/v1/models")
    async def models():
        return await router.forward_get("/v1/models")

    @app.get("/health")
    async def health():
        n = sum(r.healthy for r in router.replicas.values())
        return JSONResponse({"status": "ok" if n else "no healthy replica", "healthy_replicas": n},
                            status_code=200 if n else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(router.registry), media_type="text/plain; version=0.0.4")

    @app.get("/router/replicas")
    async def replicas():
        return {"replicas": [r.describe() for r in router.replicas.values()], "queued": router.scheduler.queue_len()}

    return app
