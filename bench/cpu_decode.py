"""kestrel vs HF transformers `generate()` on the embedded SmolLM2-135M-Instruct, on the CPU.

Both run in this process on the same chat prompts, greedy, the same number of new tokens (EOS ignored), the same
weights (transformers loads the same GGUF). Runs alternate between the two (so machine-load drift hits both), the
best of --repeats is kept, and token ids are compared. Prints tokens/s and the kestrel/HF ratio per batch size;
--out writes a markdown report.

    python bench/cpu_decode.py                       # batch 1 and 8, 64 new tokens, fp32 both
    python bench/cpu_decode.py --kestrel-dtypes float32 bfloat16 --out bench/results/cpu_decode.md
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:
        return platform.processor() or "unknown"


def chat_prompts(tok, n: int) -> list[str]:
    return [tok.apply_chat_template([{"role": "user", "content": f"Write a short poem about number {i}."}],
                                    add_generation_prompt=True, tokenize=False) for i in range(n)]


def run_hf(model, tok, prompts, new_tokens):
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    dt = time.perf_counter() - t0
    return dt, [row[enc["input_ids"].shape[1]:].tolist() for row in out]


def run_kestrel(engine, prompts, new_tokens):
    from kestrel.engine import SamplingParams

    engine.block_manager.reset_prefix_cache()  # every repeat starts cold (no hits from the previous one)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    t0 = time.perf_counter()
    outs = engine.generate(ids, params)
    dt = time.perf_counter() - t0
    return dt, [o.output_token_ids for o in outs]


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    same = sum(x == y for x, y in zip(a, b))
    first = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None) for x, y in zip(a, b)]
    div = [f for f in first if f is not None]
    return f"{same}/{len(a)} identical" + (f" (first divergence at token {min(div)})" if div else "")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="concurrent requests per run")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request (EOS ignored)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per case (best kept), after one warm-up")
    ap.add_argument("--kestrel-dtypes", nargs="+", default=["float32"], help="kestrel weight dtypes to run")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--out", default=None, help="write a markdown report here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from kestrel.engine import EngineConfig, LLMEngine
    from kestrel.model.loader import embedded_gguf_path

    path = embedded_gguf_path()
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    hf_load = time.perf_counter() - t0
    engines, loads = {}, {}
    for dt in args.kestrel_dtypes:
        t0 = time.perf_counter()
        engines[dt] = LLMEngine(EngineConfig(dtype=dt, max_num_seqs=max(args.batch_sizes), progress=False))
        loads[dt] = time.perf_counter() - t0
    tok = engines[args.kestrel_dtypes[0]].tokenizer
    print(f"loaded: HF {hf_load:.1f}s, kestrel " + ", ".join(f"{d} {s:.1f}s" for d, s in loads.items()))

    rows = []
    for bs in args.batch_sizes:
        prompts = chat_prompts(tok, bs)
        best = {"hf": float("inf"), **{d: float("inf") for d in engines}}
        raw = {k: [] for k in best}
        outs = {}
        for rep in range(args.repeats + 1):  # rep 0 = warm-up
            dt, o = run_hf(hf, tok, prompts, args.new_tokens)
            outs["hf"] = o
            if rep:
                best["hf"] = min(best["hf"], dt)
                raw["hf"].append(dt)
            for d, eng in engines.items():
                dt, o = run_kestrel(eng, prompts, args.new_tokens)
                outs[d] = o
                if rep:
                    best[d] = min(best[d], dt)
                    raw[d].append(dt)
        n = bs * args.new_tokens
        hf_tps = n / best["hf"]
        for d in engines:
            tps = n / best[d]
            row = dict(batch=bs, dtype=d, hf_tps=hf_tps, kestrel_tps=tps, ratio=tps / hf_tps,
                       same=agreement(outs[d], outs["hf"]),
                       raw=f"HF {', '.join(f'{n / t:.1f}' for t in raw['hf'])}; kestrel "
                           f"{', '.join(f'{n / t:.1f}' for t in raw[d])}")
            rows.append(row)
            print(f"batch {bs:2d}  HF fp32 {hf_tps:7.1f} tok/s   kestrel {d} {tps:7.1f} tok/s   "
                  f"ratio {row['ratio']:.2f}x   greedy tokens vs HF: {row['same']}", flush=True)

    if args.out:
        load = os.getloadavg()
        with open(args.out, "w") as f:
            f.write("# CPU decode: kestrel vs HF transformers generate (SmolLM2-135M-Instruct Q4_1 GGUF)\n\n")
            f.write(f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}\n")
            f.write(f"- machine: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, "
                    f"{torch.get_num_threads()} threads; load average at the end {load[0]:.1f} / {load[1]:.1f} "
                    f"(other jobs share this machine)\n")
            f.write(f"- command: `python bench/cpu_decode.py {' '.join(sys.argv[1:])}`\n")
            f.write(f"- {args.new_tokens} new tokens per request, greedy, EOS ignored; best of {args.repeats} "
                    f"timed runs after a warm-up, runs alternating HF / kestrel; time includes prefill\n\n")
            f.write("| batch | HF fp32 tok/s | kestrel dtype | kestrel tok/s | ratio | greedy tokens vs HF | "
                    "every timed run, tok/s |\n")
            f.write("|---:|---:|---|---:|---:|---|---|\n")
            for r in rows:
                f.write(f"| {r['batch']} | {r['hf_tps']:.1f} | {r['dtype']} | {r['kestrel_tps']:.1f} | "
                        f"{r['ratio']:.2f}x | {r['same']} | {r['raw']} |\n")
        print("wrote", args.out)


if __name__ == "__main__":
    main()
