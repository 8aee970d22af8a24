"""Host (Python) cost per engine step at decode batch sizes 1..256, by phase, on a model whose forward is ~free.

The engine is the real one (scheduler, block manager, model runner, sampler, detokenizer, async step); the model is
a random 1-layer Llama with hidden 64 and SmolLM2's vocabulary (49152) and tokenizer, so detokenization is
realistic. Each batch size: B requests (prompt --prompt-tokens, ignore_eos, greedy, logprobs=0 as
bench/serve_throughput.py sends) are prefilled, then
the best of --repeats chunks of --steps decode steps is kept. Phases are timed with wrappers around the
engine's own methods:

  schedule   Scheduler.schedule
  prepare    ModelRunner.prepare (flat inputs + attention metadata; on CUDA the graph inputs)
  forward    ModelRunner.execute (the model: device work on a GPU, excluded from host time)
  sample     the Sampler (argmax of [B, vocab]: device work on a GPU, excluded)
  commit     everything else in step(): token append, stop checks, detokenization, outputs
  host       the engine thread's CPU time per step, less forward and sample (sync engine)
All phases are CPU time of the thread that ran them (time.thread_time), so other load on the box does not count;
"step ms" is wall time.

The server path (--server-batch): the server's engine thread (AsyncLLMEngine) and bs concurrent streams on an
event loop that turn each output into an SSE chunk as kestrel/server/completions.py does (no socket).

    python bench/engine_host_overhead.py --out bench/results/engine_host_overhead.md --label after
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))  # serve_throughput's workload generator

from kestrel.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

TINY = dict(architecture="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
            eos_token_ids=[2])


class PhaseTimer:
    """Wraps bound methods with accumulators of the calling thread's CPU time (time.thread_time: robust to other
    processes on a shared box; a phase run on the async worker thread counts there, not on the engine thread)."""

    def __init__(self):
        self.t = defaultdict(float)
        self.on = False

    def wrap(self, obj, name, phase):
        fn = getattr(obj, name)

        def timed(*a, **k):
            if not self.on:
                return fn(*a, **k)
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                self.t[phase] += time.thread_time() - t0
        setattr(obj, name, timed)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _timed_chunk(eng, timer, steps):
    timer.t.clear()
    timer.on = True
    wait0 = eng.async_stepper.wait_s if eng.async_stepper is not None else 0.0
    c0 = time.thread_time()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    wall = time.perf_counter() - t0
    cpu = time.thread_time() - c0
    timer.on = False
    ph = {k: 1e3 * v / steps for k, v in timer.t.items()}
    cpu_ms = 1e3 * cpu / steps  # the engine thread's CPU time per step
    if eng.async_stepper is None:  # forward + sample ran on this thread (torch threads = 1): not host work
        ph["host"] = cpu_ms - ph.get("forward", 0.0) - ph.get("sample", 0.0)
        ph["commit"] = ph["host"] - ph.get("schedule", 0.0) - ph.get("prepare", 0.0)
    else:  # forward + sample ran on the worker thread; commit was timed directly
        ph["wait"] = 1e3 * (eng.async_stepper.wait_s - wait0) / steps
        ph["host"] = cpu_ms
    ph["step"] = 1e3 * wall / steps
    return ph


def measure(eng, timer, bs, prompt_tokens, steps, vocab, seed, logprobs, repeats):
    """The best (least host time) of `repeats` chunks of `steps` decode steps: CPU time still grows when another
    process shares the core (SMT, caches), so the minimum is the honest estimate on a shared box."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=repeats * steps + 64, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    for i in range(bs):
        eng.add_request(f"b{bs}-{i}", torch.randint(300, vocab, (prompt_tokens,), generator=g).tolist(), params)
    while any(s.num_computed_tokens < s.prompt_len for s in eng.seqs.values()):  # prefill (untimed)
        eng.step()
    for _ in range(3):  # warm-up decodes
        eng.step()
    best = min((_timed_chunk(eng, timer, steps) for _ in range(repeats)), key=lambda ph: ph["host"])
    for rid in list(eng.seqs):
        eng.abort_request(rid)
    eng.drain()
    eng.block_manager.reset_prefix_cache()
    return best


def server_path(eng, timer, bs, prompt_tokens, new_tokens, vocab, logprobs):
    """AsyncLLMEngine (the server's engine thread) + bs concurrent streams on one event loop, each turning every
    output into an SSE chunk as kestrel/server/completions.py does (no HTTP socket). Returns (engine-thread host
    ms per step, event-loop CPU us per streamed token)."""
    import asyncio
    import threading

    from kestrel.engine.async_engine import AsyncLLMEngine
    from kestrel.server.completions import _logprobs
    from kestrel.server.serving import TokenStrings, sse
    token_str = TokenStrings(eng.tokenizer)

    g = torch.Generator().manual_seed(bs + 1)
    prompts = [torch.randint(300, vocab, (prompt_tokens,), generator=g).tolist() for _ in range(bs)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    aeng = AsyncLLMEngine(eng)
    engine_cpu = [0.0]
    inner = aeng._step

    def timed_step(*a):  # the engine thread's whole iteration work: step + handing outputs to the streams
        t0 = time.thread_time()
        try:
            return inner(*a)
        finally:
            engine_cpu[0] += time.thread_time() - t0
    aeng._step = timed_step

    async def stream(i):
        n = offset = 0
        async for out in aeng.generate(f"s{bs}-{i}", prompts[i], params):
            lp = _logprobs(token_str, out.logprobs, offset)
            offset += len(out.new_text)
            body = {"id": "cmpl-x", "object": "text_completion", "created": 0, "model": "m",
                    "choices": [{"index": 0, "text": out.new_text, "logprobs": lp,
                                 "finish_reason": out.finish_reason if out.finished else None}]}
            sse(body)
            n += 1
        return n

    async def run_all():
        return sum(await asyncio.gather(*(stream(i) for i in range(bs))))

    assert threading.current_thread() is threading.main_thread()
    steps0 = eng.num_steps
    timer.t.clear()
    timer.on = True
    c0 = time.thread_time()
    tokens = asyncio.run(run_all())
    loop_cpu = time.thread_time() - c0
    timer.on = False
    aeng.shutdown()
    eng.block_manager.reset_prefix_cache()
    steps = eng.num_steps - steps0
    host = engine_cpu[0] - timer.t.get("forward", 0.0) - timer.t.get("sample", 0.0)
    return 1e3 * host / steps, 1e6 * loop_cpu / tokens, steps


def mixed_steps(eng, timer, concurrency, n_requests, logprobs):
    """Closed loop at `concurrency` over ShareGPT-like lengths (bench/serve_throughput.py's generator): how many
    steps carry a prefill chunk (on a GPU those run eager: the decode CUDA graphs need pure-decode steps) and the
    host ms per step over the whole run."""
    from serve_throughput import sharegpt_like

    reqs = sharegpt_like(n_requests, 0, eng.model_config.vocab_size, 1024, 512)
    mixed = [0]
    prep = eng.runner.prepare

    def counting(batch):
        st = prep(batch)
        mixed[0] += bool(st.meta is not None and st.meta.prefills)
        return st
    eng.runner.prepare = counting
    nxt = 0

    def refill():
        nonlocal nxt
        while len(eng.seqs) < concurrency and nxt < len(reqs):
            ids, out_len = reqs[nxt]
            eng.add_request(f"m{nxt}", ids, SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True,
                                                            logprobs=logprobs))
            nxt += 1
    timer.t.clear()
    timer.on = True
    steps0, c0 = eng.num_steps, time.thread_time()
    refill()
    while eng.has_unfinished():
        eng.step()
        refill()
    eng.drain()
    cpu = time.thread_time() - c0
    timer.on = False
    eng.runner.prepare = prep
    steps = eng.num_steps - steps0
    host = 1e3 * (cpu - timer.t.get("forward", 0.0) - timer.t.get("sample", 0.0)) / steps
    return steps, mixed[0], host


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--async", dest="async_modes", type=int, nargs="+", default=[0, 1],
                    help="async scheduling off (0) / on (1)")
    ap.add_argument("--repeats", type=int, default=3, help="timed chunks of --steps per batch size (best kept)")
    ap.add_argument("--logprobs", type=int, default=0,
                    help="logprobs per request (bench/serve_throughput.py sends 0: one chunk per token); -1: none")
    ap.add_argument("--server-batch", type=int, default=256, help="streams for the server-path measurement (0: skip)")
    ap.add_argument("--mix", type=int, default=0, help="closed-loop ShareGPT-like run of this many requests at "
                    "the largest batch size: fraction of steps with a prefill (0: skip)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--label", default="run")
    ap.add_argument("--out", default=None, help="append a markdown section to this file")
    args = ap.parse_args()
    args.logprobs = None if args.logprobs < 0 else args.logprobs
    if os.environ.get("MALLOC_MMAP_MAX_") is None:
        # glibc hands the ~50 MB [256, 49152] logits back to the OS each step (munmap) and page-faults them in
        # again: a CPU-allocator artifact a GPU caching allocator does not have, ~10 ms that would land in "commit".
        # Keep big blocks on the heap instead (re-exec: glibc reads these only at start-up).
        env = dict(os.environ, MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(1 << 40))
        os.execve(sys.executable, [sys.executable] + sys.argv, env)
    torch.set_num_threads(args.threads)
    rows = []
    for mode in args.async_modes:
        eng = LLMEngine(EngineConfig(load_format="dummy", model_shape=dict(TINY), progress=False,
                                     max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=8192,
                                     num_kv_blocks=max(args.batch_sizes) * ((args.prompt_tokens + args.steps + 80)
                                                                            // 16 + 2),
                                     async_scheduling=bool(mode)))
        timer = PhaseTimer()
        timer.wrap(eng.scheduler, "schedule", "schedule")
        timer.wrap(eng.runner, "prepare", "prepare")
        timer.wrap(eng.runner, "execute", "forward")
        timer.wrap(eng.runner, "sampler", "sample")
        if eng.async_stepper is not None:
            timer.wrap(eng.async_stepper, "_commit", "commit")
        vocab = eng.model_config.vocab_size
        for bs in args.batch_sizes:
            ph = measure(eng, timer, bs, args.prompt_tokens, args.steps, vocab, bs, args.logprobs, args.repeats)
            rows.append((mode, bs, ph))
            print(f"async={mode} batch {bs:4d}: host {ph['host']:7.2f} ms/step  (schedule {ph.get('schedule', 0):.2f}"
                  f" prepare {ph.get('prepare', 0):.2f} commit {ph.get('commit', 0):.2f} | forward "
                  f"{ph.get('forward', 0):.2f} sample {ph.get('sample', 0):.2f} step {ph['step']:.2f})", flush=True)
    server_rows = []
    if args.server_batch:  # the server's engine thread + event loop (sync engine: phases on the engine thread)
        eng = LLMEngine(EngineConfig(load_format="dummy", model_shape=dict(TINY), progress=False,
                                     max_num_seqs=args.server_batch, max_num_batched_tokens=8192,
                                     num_kv_blocks=args.server_batch * ((args.prompt_tokens + 80) // 16 + 2),
                                     async_scheduling=False))
        timer = PhaseTimer()
        timer.wrap(eng.runner, "execute", "forward")
        timer.wrap(eng.runner, "sampler", "sample")
        server_path(eng, timer, 16, 32, 4, eng.model_config.vocab_size, args.logprobs)  # warm-up
        runs = [server_path(eng, timer, args.server_batch, args.prompt_tokens, 64, eng.model_config.vocab_size,
                            args.logprobs) for _ in range(2)]  # best of 2 of each (shared box)
        host, loop_us, steps = min(r[0] for r in runs), min(r[1] for r in runs), runs[0][2]
        server_rows.append((args.server_batch, host, loop_us, steps))
        print(f"server path, {args.server_batch} streams x 64 tokens: engine thread host {host:.2f} ms/step over "
              f"{steps} steps, event loop {loop_us:.1f} us CPU per streamed token", flush=True)
    mix_row = None
    if args.mix:
        c = max(args.batch_sizes)
        eng = LLMEngine(EngineConfig(load_format="dummy", model_shape=dict(TINY), progress=False, max_num_seqs=c,
                                     max_num_batched_tokens=2048,  # serve_throughput.py's --max-batched-tokens
                                     num_kv_blocks=c * 100, async_scheduling=False))
        timer = PhaseTimer()
        timer.wrap(eng.runner, "execute", "forward")
        timer.wrap(eng.runner, "sampler", "sample")
        steps, mixed, host = mixed_steps(eng, timer, c, args.mix, args.logprobs)
        mix_row = (c, steps, mixed, host)
        print(f"mix: C={c}, {args.mix} ShareGPT-like requests: {steps} steps, {mixed} with a prefill "
              f"({100 * mixed / steps:.0f} %), host {host:.2f} ms/step", flush=True)
    if args.out:
        lines = [f"## {args.label}", "",
                 f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
                 f"- CPU: {cpu_name()} ({os.cpu_count()} cores visible), torch threads {torch.get_num_threads()}, "
                 f"torch {torch.__version__}",
                 f"- command: `python {shlex.join(sys.argv)}`",
                 f"- prompt {args.prompt_tokens} tokens, best of {args.repeats} x {args.steps} timed decode steps per "
                 f"batch size, greedy, "
                 f"logprobs={args.logprobs}",
                 "",
                 "| async | batch | host ms/step | schedule | prepare | commit | forward (device) | sample (device) "
                 "| step ms |", "|---|---|---|---|---|---|---|---|---|"]
        for mode, bs, ph in rows:
            lines.append(f"| {'on' if mode else 'off'} | {bs} | **{ph['host']:.2f}** | {ph.get('schedule', 0):.2f} | "
                         f"{ph.get('prepare', 0):.2f} | {ph.get('commit', 0):.2f} | {ph.get('forward', 0):.2f} | "
                         f"{ph.get('sample', 0):.2f} | {ph['step']:.2f} |")
        for b, host, loop_us, steps in server_rows:
            lines += ["", f"Server path ({b} concurrent streams x 64 tokens, prompt {args.prompt_tokens}, sync engine, "
                      f"AsyncLLMEngine + completions-style SSE chunks on one event loop, no socket; best of 2): "
                      f"engine thread "
                      f"host **{host:.2f} ms/step** ({steps} steps, forward/sample excluded), event loop "
                      f"**{loop_us:.1f} us CPU per streamed token**"]
        if mix_row is not None:
            c, steps, mixed, host = mix_row
            lines += ["", f"Closed loop at C={c} over {args.mix} ShareGPT-like requests (serve_throughput.py's "
                      f"lengths, sync engine, 2048-token step budget as serve_throughput.py): {steps} steps, **{mixed} "
                      f"({100 * mixed / steps:.0f} %) carry a prefill chunk** "
                      f"(eager on a GPU: the decode CUDA graphs need pure-decode steps); host {host:.2f} ms/step "
                      f"over the run"]
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()
