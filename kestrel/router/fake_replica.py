"""A model-free stand-in for `kestrel serve`, for testing the router's own logic fast: it speaks the same HTTP
surface (/v1/chat/completions and /v1/completions with SSE, /health, /metrics with the same metric names) and keeps
a real prefix cache of prompt chunks so prefix hits are measurable. Tokens are "t0 t1 ..." after a fixed delay.

    python -m kestrel.router.fake_replica --port 8001 --token-delay 0.01 --max-running 2
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time
from collections import OrderedDict

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kestrel.router.gateway import prompt_text


def create_fake_app(name: str, token_delay: float, max_running: int, chunk_chars: int = 64,
                    cache_chunks: int = 10_000) -> FastAPI:
    app = FastAPI()
    sem = asyncio.Semaphore(max_running)
    cache: OrderedDict[bytes, None] = OrderedDict()
    st = {"running": 0, "waiting": 0, "hits": 0, "queries": 0}
    log: list[dict] = []

    def prefill(text: str) -> int:
        """Look the prompt's chunk chain up in the cache (like the engine's block hashes), then insert it."""
        prev, hit, chain = b"", True, []
        for i in range(0, len(text) - chunk_chars + 1, chunk_chars):
            prev = hashlib.sha256(prev + text[i:i + chunk_chars].encode()).digest()
            chain.append(prev)
        hits = 0
        for h in chain:
            if hit and h in cache:
                hits += 1
                cache.move_to_end(h)
            else:
                hit = False
                cache[h] = None
        while len(cache) > cache_chunks:
            cache.popitem(last=False)
        st["queries"] += len(chain) * chunk_chars
        st["hits"] += hits * chunk_chars
        return hits

    async def generate(request: Request, chat: bool):
        body = await request.json()
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        entry = {"tenant": request.headers.get("x-tenant"), "priority": body.get("priority"),
                 "arrived": time.monotonic(), "prompt": prompt_text(body)[:80]}
        log.append(entry)
        st["waiting"] += 1
        await sem.acquire()
        st["waiting"] -= 1
        st["running"] += 1
        entry["cached_chunks"] = prefill(prompt_text(body))
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(i: int, finish=None):
            tok = f"t{i} "
            choice = ({"index": 0, "delta": {"content": tok}, "finish_reason": finish} if chat
                      else {"index": 0, "text": tok, "finish_reason": finish})
            return {"id": "fake", "object": obj, "model": name, "choices": [choice]}

        async def stream():
            try:
                for i in range(n):
                    await asyncio.sleep(token_delay)
                    c = chunk(i, "length" if i == n - 1 else None)
                    yield f"data: {json.dumps(c)}\n\n".encode()
                yield b"data: [DONE]\n\n"
            finally:
                st["running"] -= 1
                sem.release()

        if body.get("stream"):
            return StreamingResponse(stream(), media_type="text/event-stream")
        try:
            await asyncio.sleep(token_delay * n)
        finally:
            st["running"] -= 1
            sem.release()
        text = "".join(f"t{i} " for i in range(n))
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                  if chat else {"index": 0, "text": text, "finish_reason": "length"})
        return JSONResponse({"id": "fake", "object": "chat.completion" if chat else "text_completion",
                             "model": name, "choices": [choice], "replica": name})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/fake/log")
    async def get_log():
        return log

    @app.get("/metrics")
    async def metrics():
        text = (f"# TYPE kestrel_num_requests_running gauge\nkestrel_num_requests_running {st['running']}\n"
                f"# TYPE kestrel_num_requests_waiting gauge\nkestrel_num_requests_waiting {st['waiting']}\n"
                f"# TYPE kestrel_kv_cache_usage_perc gauge\nkestrel_kv_cache_usage_perc "
                f"{len(cache) / cache_chunks}\n"
                f"# TYPE kestrel_prefix_cache_queries counter\nkestrel_prefix_cache_queries_total {st['queries']}\n"
                f"# TYPE kestrel_prefix_cache_hits counter\nkestrel_prefix_cache_hits_total {st['hits']}\n")
        return Response(text, media_type="text/plain; version=0.0.4")

    return app


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="model-free fake replica for router tests")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--name", default="fake")
    p.add_argument("--token-delay", type=float, default=0.01, help="seconds per generated token")
    p.add_argument("--max-running", type=int, default=4, help="requests generating at once; the rest wait")
    args = p.parse_args(argv)
    import uvicorn
    uvicorn.run(create_fake_app(args.name, args.token_delay, args.max_running), host=args.host, port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
