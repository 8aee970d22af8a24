"""Where the time of a speculative step goes on a GPU (issue #6): device time of the captured forwards, and the
wall time of real engine steps split into host phases and the wait for the device.

Part 1, GPU floors (CUDA events around N back-to-back replays, nothing else queued): the decode graph (1 token per
row, what no-spec runs) and the verify graphs (K+1 tokens per row) at batch buckets 1 and 64, context ~300 tokens.
Part 2, engine steps (greedy, ignore_eos, chat prompts of bench/spec_decode.py, n-gram drafter): no-spec with the
engine's async scheduling, and the synchronous speculative step with k=4 and the confidence scheduler. Each spec
step is split by wrapping the engine's own functions (wall clock, engine thread):
  schedule   Scheduler.schedule
  draft      SpecDecoder._draft (n-gram propose, spec scheduler, KV blocks for the drafts)
  launch     VerifyGraphs.run: packing the padded inputs, host-to-device copies, queueing the replay
  gpu_wait   torch.cuda.synchronize() right after the launch: the device time the host did not hide
  accept     the rest of _graph_forward (argmax copy, greedy acceptance, drafter feedback)
  commit     the rest of SpecDecoder.step (KV bookkeeping, token append, detokenize, stop checks, outputs)
"host" = step wall - gpu_wait. An ideal overlapped step costs max(host, gpu) instead of host + gpu.

  python bench/spec_step_cost.py --model $SMOL_GGUF --tokenizer $SMOL_TOK --device cuda --dtype bfloat16
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import kestrel.spec  # noqa: E402,F401  (registers the speculative step)
from kestrel.engine.config import EngineConfig  # noqa: E402
from kestrel.engine.llm_engine import LLMEngine  # noqa: E402
from kestrel.engine.sampling_params import SamplingParams  # noqa: E402
from kestrel.spec.config import parse_speculative  # noqa: E402
from kestrel.spec.decoder import SpecDecoder  # noqa: E402
from kestrel.spec.factory import build_drafter, spec_loop, verify_graphs  # noqa: E402
from spec_decode import WORKLOADS, chat_prompts  # noqa: E402

sync = lambda: torch.cuda.synchronize() if torch.cuda.is_available() else None
PHASES = ("schedule", "draft", "launch", "gpu_wait", "accept", "commit")


def gpu_floors(engine, vg, ctx_len: int, reps: int) -> list[tuple]:
    """ms per replay of the decode graph and the verify graphs, rows of a ctx_len-token context."""
    dg, bsz = engine.runner.graphs, engine.block_manager.block_size
    nb = -(-(ctx_len + max(vg.k_sizes) + 2) // bsz)  # room for the widest verify chunk
    out = []
    ev = lambda: torch.cuda.Event(enable_timing=True)
    for bs in (1, 64):
        if dg.bucket(bs) != bs:
            continue
        tables = torch.arange(bs * nb, dtype=torch.int32).view(bs, nb) % engine.block_manager.num_blocks
        pos = torch.full((bs,), ctx_len, dtype=torch.long)
        slots = tables[:, ctx_len // bsz].long() * bsz + ctx_len % bsz
        dg.run(torch.zeros(bs, dtype=torch.long), pos, slots, tables, (pos + 1).int())
        torch.cuda.synchronize()
        a, b = ev(), ev()
        a.record()
        for _ in range(reps):
            dg.graphs[bs].replay()
        b.record()
        torch.cuda.synchronize()
        out.append((bs, "decode (1 token/row)", a.elapsed_time(b) / reps))
        for K in vg.k_sizes:
            rows = [(0, [0] * K, ctx_len, tables[i].tolist()) for i in range(bs)]
            vg.run(rows)
            torch.cuda.synchronize()
            a, b = ev(), ev()
            a.record()
            for _ in range(reps):
                vg.graphs[(bs, K)].replay()
            b.record()
            torch.cuda.synchronize()
            out.append((bs, f"verify K={K} ({K + 1} tokens/row)", a.elapsed_time(b) / reps))
    return out


class Phases:
    def __init__(self):
        self.t = defaultdict(float)
        self.stack: list[float] = []
        self.on = False

    def wrap(self, obj, name, phase, sync_after=False):
        fn = getattr(obj, name)

        def timed(*a, **k):
            if not self.on:
                return fn(*a, **k)
            t0 = time.perf_counter()
            self.stack.append(0.0)
            try:
                r = fn(*a, **k)
            finally:
                inner = self.stack.pop()
                dt = time.perf_counter() - t0
                if sync_after:  # split the device wait off the launch
                    t1 = time.perf_counter()
                    sync()
                    w = time.perf_counter() - t1
                    self.t["gpu_wait"] += w
                    dt += w
                    inner += w
                self.t[phase] += dt - inner
                if self.stack:
                    self.stack[-1] += dt
            return r
        setattr(obj, name, timed)


def run(engine, prompts, params, timer=None) -> dict:
    rids = [f"s{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for r, p in zip(rids, prompts):
        engine.add_request(r, p, params)
    steps, tokens, wall_dec, t0 = 0, 0, 0.0, time.perf_counter()
    while engine.has_unfinished():
        all_decode = all(s.num_output_tokens > 0 for s in engine.scheduler.running) and not engine.scheduler.waiting
        if timer is not None:
            timer.on = all_decode
        ts = time.perf_counter()
        outs = engine.step()
        if all_decode:  # steady decode steps only (prefill steps excluded)
            wall_dec += time.perf_counter() - ts
            steps += 1
            tokens += sum(len(o.new_token_ids) for o in outs)
    engine.drain()
    sync()
    if timer is not None:
        timer.on = False
    return {"wall": time.perf_counter() - t0, "steps": steps, "tokens": tokens, "wall_dec": wall_dec}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--buckets", type=int, nargs="+", default=[1, 64],
                    help="decode/verify graph batch buckets to capture (fewer = shorter start-up)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--verify-k", type=int, nargs="+", default=None,
                    help="verify graphs to time in part 1 (K drafts + 1 tokens per row; default: the engine's "
                         "buckets up to 4); e.g. 8 16 32 prices a draft tree of that many tokens")
    ap.add_argument("--floors-only", action="store_true", help="part 1 only (no engine steps)")
    args = ap.parse_args(argv)
    if args.tokenizer:
        import kestrel.model.loader as loader
        from transformers import AutoTokenizer
        loader.load_tokenizer = lambda kind, path: AutoTokenizer.from_pretrained(args.tokenizer)
    import kestrel.engine.cuda_graphs as cg
    cg.default_batch_buckets = lambda max_num_seqs: sorted(set(args.buckets))
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=max(args.concurrency),
                                    kv_cache_gb=1.0, enable_prefix_caching=False, max_num_batched_tokens=4096,
                                    progress=False))
    if args.verify_k and getattr(engine.runner, "graphs", None) is not None:
        from kestrel.spec.verify_graph import VerifyGraphs
        r, b = engine.runner, engine.runner.backend
        vg = VerifyGraphs(r.model, b.k_cache, b.v_cache, r.graphs.batch_sizes, sorted(set(args.verify_k)),
                          -(-engine.max_model_len // r.block_size), r.cfg.sliding_window)
        vg.capture()
    else:
        vg = verify_graphs(engine, 4)
    print(f"engine + verify graphs ready in {time.perf_counter() - t0:.1f}s", flush=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"
    lines = [f"GPU: {gpu}, torch {torch.__version__}, SmolLM2-135M {args.dtype}", "",
             "| batch | graph | device ms/replay |", "|---|---|---|"]
    for bs, name, ms in (gpu_floors(engine, vg, 300, args.reps) if vg is not None else []):
        lines.append(f"| {bs} | {name} | {ms:.3f} |")
        print(lines[-1], flush=True)

    if args.floors_only:
        _write(lines, args.out)
        return
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    stepper = engine.async_stepper
    timer = Phases()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    if vg is not None:
        timer.wrap(vg, "run", "launch", sync_after=True)
    run(engine, chat_prompts(engine.tokenizer, 2, texts=WORKLOADS["chat"]), SamplingParams(max_tokens=8))  # warm-up
    lines += ["", "| conc | mode | decode steps | tokens/step | wall ms/step | host ms/step | "
              + " | ".join(PHASES) + " |", "|---" * (6 + len(PHASES)) + "|"]
    for c in args.concurrency:
        prompts = chat_prompts(engine.tokenizer, c, texts=WORKLOADS["chat"])
        for mode, spec in (("nospec (async)", None), ("ngram k=4 sync", "drafter=ngram,schedule=fixed,k=4,loop=off"),
                           ("ngram conf sync", "drafter=ngram,schedule=confidence,k=4,loop=off"),
                           ("ngram k=1 loop", "drafter=ngram,schedule=fixed,k=1"),
                           ("ngram k=4 loop", "drafter=ngram,schedule=fixed,k=4"),
                           ("ngram conf loop", "drafter=ngram,schedule=confidence,k=4")):
            engine.drain()
            engine.spec, engine.async_stepper = None, stepper
            if spec is not None:
                cfg = parse_speculative(spec)
                dec = SpecDecoder(cfg, build_drafter(cfg, engine), args.device)
                dec.graphs = vg
                dec.loop = spec_loop(engine, cfg, dec.drafter)
                timer.wrap(dec, "_draft", "draft")
                timer.wrap(dec, "_graph_forward", "accept")
                timer.wrap(dec, "step", "commit")
                engine.spec, engine.async_stepper = dec, None
            timer.t.clear()
            r = run(engine, prompts, params, timer if spec is not None else None)
            n = max(r["steps"], 1)
            ph = {p: 1e3 * timer.t[p] / n for p in PHASES}
            wall = 1e3 * r["wall_dec"] / n
            host = wall - ph["gpu_wait"] if spec is not None else float("nan")
            looped = spec is not None and dec.loop_k_steps
            if looped:  # overlapped loop: no phases (the host work overlaps the device); K steps + device ms per K
                host = float("nan")
                lp = dec.loop
                ph_txt = f"loop steps per K {dict(sorted(dec.loop_k_steps.items()))}, device ms per (bucket, K) " \
                         f"{ {k: round(v, 3) for k, v in sorted(lp.gpu_ms.items())} }, host ms/step {lp.host_ms:.3f}"
                cells = [ph_txt] + ["-"] * (len(PHASES) - 1)
            else:
                cells = [f"{ph[p]:.3f}" if spec is not None else "-" for p in PHASES]
            lines.append(f"| {c} | {mode} | {r['steps']} | {r['tokens'] / n:.2f} | {wall:.3f} | {host:.3f} | "
                         + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    engine.spec, engine.async_stepper = None, stepper
    _write(lines, args.out)


def _write(lines, out) -> None:
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
