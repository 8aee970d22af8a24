"""Event-loop CPU per streamed token in the OpenAI server, by phase, with a model whose forward is ~free.

The real FastAPI app (kestrel/server/app.py) over the real AsyncLLMEngine and engine (a random 1-layer Llama with
SmolLM2's vocabulary and tokenizer, so detokenization and token strings are real), driven in-process through ASGI:
N concurrent streaming requests (random prompts, greedy, ignore_eos, --tokens each). No socket and no uvicorn:
the ASGI `send` only counts bytes, so uvicorn's own per-write cost (about one transport.write per SSE message) is
not in these numbers. The event loop runs on the main thread; its CPU (time.thread_time) over the run divided by
the streamed tokens is the number reported. The engine thread's CPU is not counted (it shares the GIL, so every
us here is a us the engine cannot run on a busy server).

Rows ("phases" by difference):
  stream     AsyncLLMEngine.generate consumed directly: delivery into each request's stream, no server code
  cmpl       POST /v1/completions, stream, no logprobs
  cmpl+lp0   ... with logprobs=0 (what bench/serve_throughput.py sends)
  chat       POST /v1/chat/completions, stream, no logprobs
  chat+lp2   ... with logprobs=true, top_logprobs=2

    python bench/server_stream_overhead.py --streams 256 --tokens 64 [--api-key k]
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout

import torch  # noqa: E402

from kestrel.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from kestrel.engine.async_engine import AsyncLLMEngine  # noqa: E402
from kestrel.server.app import create_app  # noqa: E402

from engine_host_overhead import TINY, cpu_name  # noqa: E402  (bench/ is on sys.path when run as a script)

API_KEY = None  # --api-key: the app guards /v1/ and each request sends the key


async def post_stream(app, path: str, body: dict) -> tuple[int, int]:
    """One streaming request through the ASGI app; returns (SSE events, bytes)."""
    raw = json.dumps(body).encode()
    done = asyncio.Event()
    sent = [False]
    counts = [0, 0]

    async def receive():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(msg):
        if msg["type"] == "http.response.start":
            assert msg["status"] == 200, msg
        elif msg["type"] == "http.response.body":
            b = msg.get("body", b"")
            counts[0] += b.count(b"data: ")
            counts[1] += len(b)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")]
             + ([(b"authorization", f"Bearer {API_KEY}".encode())] if API_KEY else []), "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 8000)}
    try:
        await app(scope, receive, send)
    finally:
        done.set()
    return counts[0], counts[1]


def run(app, aeng, kind: str, streams: int, tokens: int, prompts: list[list[int]]) -> dict:
    async def one(i):
        if kind == "stream":
            params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=0)
            n = 0
            async for out in aeng.generate(f"x{time.monotonic_ns()}-{i}", prompts[i], params):
                n += len(out.new_token_ids)
            return n, 0
        common = dict(model="m", max_tokens=tokens, temperature=0.0, ignore_eos=True, stream=True)
        if kind.startswith("cmpl"):
            body = dict(common, prompt=prompts[i], **({"logprobs": 0} if kind == "cmpl+lp0" else {}))
            return await post_stream(app, "/v1/completions", body)
        body = dict(common, messages=[{"role": "user", "content": f"hello {i}"}],
                    **({"logprobs": True, "top_logprobs": 2} if kind == "chat+lp2" else {}))
        return await post_stream(app, "/v1/chat/completions", body)

    async def all_():
        return await asyncio.gather(*(one(i) for i in range(streams)))

    c0, w0 = time.thread_time(), time.perf_counter()
    res = asyncio.run(all_())
    cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
    n_tok = streams * tokens
    return dict(kind=kind, us_per_token=1e6 * cpu / n_tok, events=sum(r[0] for r in res),
                bytes=sum(r[1] for r in res), wall=wall)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--repeats", type=int, default=3, help="runs per row (best kept)")
    ap.add_argument("--kinds", nargs="+", default=["stream", "cmpl", "cmpl+lp0", "chat", "chat+lp2"])
    ap.add_argument("--api-key", default=None, help="serve with an API key (the auth middleware is in the path)")
    ap.add_argument("--label", default="run")
    args = ap.parse_args()
    global API_KEY
    API_KEY = args.api_key
    torch.set_num_threads(1)
    eng = LLMEngine(EngineConfig(load_format="dummy", model_shape=dict(TINY), progress=False,
                                 max_num_seqs=args.streams, max_num_batched_tokens=8192,
                                 num_kv_blocks=args.streams * ((64 + args.tokens + 80) // 16 + 2)))
    aeng = AsyncLLMEngine(eng)
    app = create_app(aeng, served_model_name="m", api_key=args.api_key)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(300, TINY["vocab_size"], (32,), generator=g).tolist() for _ in range(args.streams)]
    run(app, aeng, "cmpl+lp0", 8, 4, prompts)  # warm-up (imports, first-call paths)
    rows = []
    for kind in args.kinds:
        best = min((run(app, aeng, kind, args.streams, args.tokens, prompts) for _ in range(args.repeats)),
                   key=lambda r: r["us_per_token"])
        rows.append(best)
        print(f"[{args.label}] {kind:9s} {best['us_per_token']:6.1f} us/token (event loop CPU)  events {best['events']}"
              f"  bytes {best['bytes']}  wall {best['wall']:.2f} s", flush=True)
    aeng.shutdown()
    print(f"# {args.label}: {cpu_name()}, {os.cpu_count()} cores, python {platform.python_version()}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, streams {args.streams}, "
          f"tokens {args.tokens}, best of {args.repeats}")


if __name__ == "__main__":
    main()
