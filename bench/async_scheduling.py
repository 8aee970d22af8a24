"""Async vs sync scheduling of the kestrel engine, side by side in one process (the embedded SmolLM2 by default).

Two engines with the same weights and settings, `async_scheduling` on and off, generate the same greedy batch;
runs alternate (so machine-load drift hits both), the best of --repeats is kept, and token ids are compared.
Prints output tok/s per batch size and the async/sync ratio; --out writes a markdown report.

    python bench/async_scheduling.py                                  # CPU, batch 1 and 8, 64 new tokens
    python bench/async_scheduling.py --device cuda --load-format dummy --model-shape llama-3-8b --dtype bfloat16
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout

from kestrel.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402


def timed_generate(eng, prompts, new_tokens):
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    if torch.device(eng.config.device).type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    outs = eng.generate(prompts, params)
    dt = time.perf_counter() - t
    eng.block_manager.reset_prefix_cache()
    return dt, [o.output_token_ids for o in outs]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: embedded SmolLM2-135M GGUF)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--model-shape", default=None)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--out", default=None, help="write a markdown report here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    common = dict(model=args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
                  model_shape=args.model_shape, max_num_seqs=max(args.batch_sizes), progress=False,
                  enable_prefix_caching=False)
    engines = {mode: LLMEngine(EngineConfig(async_scheduling=mode, **common)) for mode in (False, True)}
    vocab = engines[False].model_config.vocab_size
    rows = []
    for bs in args.batch_sizes:
        g = torch.Generator().manual_seed(bs)
        prompts = [torch.randint(10, vocab, (args.prompt_tokens,), generator=g).tolist() for _ in range(bs)]
        for eng in engines.values():  # warm-up
            timed_generate(eng, prompts, 4)
        best = {False: float("inf"), True: float("inf")}
        tokens = {}
        for _ in range(args.repeats):
            for mode, eng in engines.items():
                dt, tokens[mode] = timed_generate(eng, prompts, args.new_tokens)
                best[mode] = min(best[mode], dt)
        tps = {m: bs * args.new_tokens / best[m] for m in best}
        same = tokens[False] == tokens[True]
        rows.append((bs, tps[False], tps[True], tps[True] / tps[False], same))
        print(f"batch {bs:3d}: sync {tps[False]:8.1f} tok/s  async {tps[True]:8.1f} tok/s  "
              f"async/sync {tps[True] / tps[False]:.3f}  same tokens: {same}", flush=True)
    if args.out:
        dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
        lines = [f"# Async vs sync scheduling ({args.device})", "",
                 f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
                 f"- device: {dev}, torch threads: {torch.get_num_threads()}, torch {torch.__version__}",
                 f"- command: `python {' '.join(sys.argv)}`",
                 f"- model: {engines[False].model_name}, dtype {args.dtype}, {args.prompt_tokens}-token prompts, "
                 f"{args.new_tokens} new tokens greedy, best of {args.repeats} alternating runs", "",
                 "| batch | sync tok/s | async tok/s | async/sync | same tokens |", "|---|---|---|---|---|"]
        lines += [f"| {b} | {s:.1f} | {a:.1f} | {r:.3f} | {same} |" for b, s, a, r, same in rows]
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
