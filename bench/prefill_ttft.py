"""Where the time to first token of a concurrency-1 chat request goes (no speculation, synchronous engine): the
wall time of the prefill step (engine.step() until the first token is out), the device time of its kernels and
their count (torch.profiler), per prompt of bench/spec_decode.py's chat set.

Why: session 10 R2 measured ~13-23 ms to the first token of ~40-token prompts (bench/spec_decode.py's TTFT column)
against ~1.1 ms per decode step: ~15% of a 128-token request at no-spec, ~20% with a tree verifying 2.5 tokens per
step, so it caps the per-user speedup of speculative decoding; this tells host-bound (many eager launches) from
device-bound.

  python bench/prefill_ttft.py --model smol.gguf --tokenizer tok --device cuda --dtype bfloat16 [--prefill-graphs]

--prefill-graphs: also capture the engine's prefill CUDA graphs (kestrel/engine/prefill_graphs.py) and measure the
eager and the graph prefill side by side in this process (alternating per prompt), with the first tokens of both
compared and the max |logit difference| of the prompts' last positions.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kestrel.engine.config import EngineConfig  # noqa: E402
from kestrel.engine.llm_engine import LLMEngine  # noqa: E402
from kestrel.engine.sampling_params import SamplingParams  # noqa: E402


def first_token(engine, rid, prompt, params, sync, tokens=None) -> float:
    """ms from add_request to the first output token (appended to `tokens`); the request is then aborted."""
    sync()
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params)
    ms = None
    while engine.has_unfinished():
        outs = engine.step()
        if ms is None and any(o.output_token_ids for o in outs):
            sync()
            ms = (time.perf_counter() - t0) * 1e3
            if tokens is not None:
                tokens.append(next(o.output_token_ids[0] for o in outs if o.output_token_ids))
            for r in list(engine.seqs):  # only the first token matters here
                engine.abort_request(r)
            engine.step()
    return ms


def last_logits(engine, prompt, graph: bool):
    """Logits at the prompt's last position through the runner's eager prefill or its prefill graph."""
    from types import SimpleNamespace
    blocks = list(range(-(-len(prompt) // engine.runner.block_size)))  # nothing else runs: any blocks will do
    seq = SimpleNamespace(token_ids=list(prompt), num_computed_tokens=0, num_tokens=len(prompt), block_table=blocks)
    batch = SimpleNamespace(seqs=[seq], num_new_tokens=[len(prompt)])
    engine.runner.use_prefill_graphs = graph
    _, logits = engine.runner.execute(engine.runner.prepare(batch))
    return logits[-1].float().clone()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prefill-graphs", action="store_true")
    args = ap.parse_args()
    if args.tokenizer:
        import kestrel.model.loader as loader
        from transformers import AutoTokenizer
        loader.load_tokenizer = lambda kind, path: AutoTokenizer.from_pretrained(args.tokenizer)
        if args.model is None and args.load_format == "dummy":
            loader.resolve = lambda model: ("hf", args.tokenizer, "dummy")
    from spec_decode import WORKLOADS, chat_prompts
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
                                    max_num_seqs=1, kv_cache_gb=1.0, enable_prefix_caching=False,
                                    max_num_batched_tokens=4096, progress=False, async_scheduling=False))
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    prompts = chat_prompts(engine.tokenizer, args.prompts, texts=WORKLOADS["chat"])
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    paths = [False]
    if args.prefill_graphs:
        t0 = time.perf_counter()
        try:  # a failed capture must not cost the eager measurement
            engine.runner.enable_prefill_graphs(engine.max_model_len)
            from kestrel.engine.prefill_graph_check import summary
            print(summary(engine.runner.prefill_graph_report), flush=True)
            if engine.runner.prefill_graphs is None:
                raise RuntimeError("every prefill graph bucket failed its self-check")
            print(f"prefill graphs {engine.runner.prefill_graphs.buckets} captured in {time.perf_counter() - t0:.1f}s")
            paths = [False, True]
        except Exception:
            import traceback
            traceback.print_exc()
            engine.runner.prefill_graphs, args.prefill_graphs = None, False
    name = {False: "eager prefill", True: "prefill graph"}
    for g in paths:
        engine.runner.use_prefill_graphs = g
        for i in range(2):  # warm-up (kernel compilation)
            first_token(engine, f"w{g}{i}", prompts[0], params, sync)
    ms, toks = {g: [] for g in paths}, {g: [] for g in paths}
    for i, p in enumerate(prompts):  # alternating, so drift hits both paths alike
        for g in (paths if i % 2 == 0 else paths[::-1]):
            engine.runner.use_prefill_graphs = g
            ms[g].append(first_token(engine, f"p{g}{i}", p, params, sync, toks[g]))
    print(f"prompt tokens {[len(p) for p in prompts]}")
    for g in paths:
        m = ms[g]
        print(f"time to first token (sync engine, no spec, {name[g]}): mean {sum(m) / len(m):.2f} ms, "
              f"min {min(m):.2f}, max {max(m):.2f}")
    if args.prefill_graphs:
        same = sum(a == b for a, b in zip(toks[False], toks[True]))
        diff = max(float((last_logits(engine, p, True) - last_logits(engine, p, False)).abs().max()) for p in prompts)
        print(f"TTFT eager / graph: {sum(ms[False]) / sum(ms[True]):.2f}x; first tokens identical "
              f"{same}/{len(prompts)}; max |logit diff| at the prompts' last positions {diff:.4g}")
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    for g in paths:
        engine.runner.use_prefill_graphs = g
        with torch.profiler.profile(activities=acts) as prof:
            wall = first_token(engine, f"prof{g}", prompts[1], params, sync)
        ev = prof.key_averages()
        if cuda:
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            dev_ms = sum(e.device_time for e in kernels) / 1e3
            print(f"profiled first token ({name[g]}): wall {wall:.2f} ms (profiler overhead included), "
                  f"{len(kernels)} device kernels/copies, their device time {dev_ms:.2f} ms")
        print(ev.table(sort_by="cpu_time_total", row_limit=8 if g else 12))
    return 0


if __name__ == "__main__":
    sys.exit(main())
