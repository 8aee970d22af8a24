"""Where the time to first token of a concurrency-1 chat request goes (no speculation, synchronous engine): the
wall time of the prefill step (engine.step() until the first token is out), the device time of its kernels and
their count (torch.profiler), per prompt of bench/spec_decode.py's chat set.

Why: session 10 R2 measured ~13-23 ms to the first token of ~40-token prompts (bench/spec_decode.py's TTFT column)
against ~1.1 ms per decode step: ~15% of a 128-token request at no-spec, ~20% with a tree verifying 2.5 tokens per
step, so it caps the per-user speedup of speculative decoding; this tells host-bound (many eager launches) from
device-bound.

  python bench/prefill_ttft.py --model smol.gguf --tokenizer tok --device cuda --dtype bfloat16
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


def first_token(engine, rid, prompt, params, sync) -> float:
    """ms from add_request to the first output token; the request then runs to its end."""
    sync()
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params)
    ms = None
    while engine.has_unfinished():
        outs = engine.step()
        if ms is None and any(o.output_token_ids for o in outs):
            sync()
            ms = (time.perf_counter() - t0) * 1e3
            for r in list(engine.seqs):  # only the first token matters here
                engine.abort_request(r)
            engine.step()
    return ms


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=8)
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
    for i in range(2):  # warm-up (kernel compilation)
        first_token(engine, f"w{i}", prompts[0], params, sync)
    ms = [first_token(engine, f"p{i}", p, params, sync) for i, p in enumerate(prompts)]
    print(f"prompt tokens {[len(p) for p in prompts]}")
    print(f"time to first token (sync engine, no spec): mean {sum(ms) / len(ms):.2f} ms, "
          f"min {min(ms):.2f}, max {max(ms):.2f}")
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        wall = first_token(engine, "prof", prompts[1], params, sync)
    ev = prof.key_averages()
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        dev_ms = sum(e.device_time for e in kernels) / 1e3
        print(f"profiled first token: wall {wall:.2f} ms (profiler overhead included), {len(kernels)} device "
              f"kernels/copies, their device time {dev_ms:.2f} ms")
    print(ev.table(sort_by="cpu_time_total", row_limit=12))
    return 0


if __name__ == "__main__":
    sys.exit(main())
