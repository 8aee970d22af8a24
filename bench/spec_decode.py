"""Speculative decoding benchmark: no-spec vs fixed k=1 (MTP-1-like) vs fixed k=4 vs confidence-scheduled, at
several concurrencies, in one process on one engine (same weights, same KV cache; only the speculative step is
swapped). Prints per-user and aggregate tok/s, the ratios to no-spec and to k=1, and acceptance statistics; with
--out, appends a markdown section (machine, date, command, raw numbers).

  python bench/spec_decode.py --concurrency 1 8 --max-tokens 64                         # CPU, n-gram drafter
  python bench/spec_decode.py --device cuda --dtype bfloat16 --drafter head --head H.safetensors \
      --concurrency 1 8 64 --max-tokens 256 --out bench/results/spec_decode.md
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import kestrel.spec  # noqa: E402,F401  (registers the speculative step)
from kestrel.engine.config import EngineConfig  # noqa: E402
from kestrel.engine.llm_engine import LLMEngine  # noqa: E402
from kestrel.engine.sampling_params import SamplingParams  # noqa: E402
from kestrel.spec.config import parse_speculative  # noqa: E402
from kestrel.spec.factory import build_spec_decoder  # noqa: E402
from kestrel.spec.train_cli import DEFAULT_PROMPTS  # noqa: E402

MODES = {"nospec": None, "k1": "schedule=fixed,k=1", "k4": "schedule=fixed,k=4", "conf": "schedule=confidence,k={kmax}"}


def chat_prompts(tok, n: int, offset: int = 0) -> list[list[int]]:
    out = []
    for i in range(n):
        t = DEFAULT_PROMPTS[(i + offset) % len(DEFAULT_PROMPTS)]
        ids = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def run_once(engine, prompts, params) -> dict:
    t0 = time.perf_counter()
    steps0 = engine.num_steps
    rids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    start = {}
    for r, p in zip(rids, prompts):
        engine.add_request(r, p, params)
        start[r] = time.perf_counter()
    ntok, finish = {}, {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                finish[o.request_id] = time.perf_counter()
                ntok[o.request_id] = len(o.output_token_ids)
    if engine.config.device.startswith("cuda"):
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    per_user = [ntok[r] / (finish[r] - start[r]) for r in rids]
    return {"wall_s": wall, "tokens": sum(ntok.values()), "steps": engine.num_steps - steps0, "per_user_tok_s": sum(per_user) / len(per_user),
            "aggregate_tok_s": sum(ntok.values()) / wall}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target model (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                    help="dummy = random weights of the model's shape (times the machinery; acceptance is meaningless)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--drafter", default="ngram", choices=["ngram", "head"])
    ap.add_argument("--head", default=None, help="draft head safetensors (for --drafter head)")
    ap.add_argument("--kmax", type=int, default=4, help="most draft tokens for the confidence scheduler")
    ap.add_argument("--token-budget", type=int, default=None, help="confidence scheduler budget (default: config's)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0], help="one table per temperature (0 = greedy)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--repeats", type=int, default=3, help="runs per (mode, concurrency); the median is reported")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="engine's async scheduling for the no-spec runs (default: the engine's auto, on for CUDA)")
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--out", default=None, help="append a markdown section with the results to this file")
    args = ap.parse_args(argv)
    if args.drafter == "head" and not args.head:
        ap.error("--drafter head needs --head FILE (train one with `kestrel train-draft`)")

    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
                                    max_num_seqs=max(args.concurrency), kv_cache_gb=args.kv_cache_gb,
                                    enable_prefix_caching=False, max_num_batched_tokens=4096, progress=False,
                                    async_scheduling=args.async_scheduling))
    extra = f",drafter={args.drafter}" + (f",head={args.head}" if args.head else "")
    if args.token_budget:
        extra += f",token_budget={args.token_budget}"

    run_once(engine, chat_prompts(engine.tokenizer, 2), SamplingParams(max_tokens=8, temperature=0))  # warm-up
    for temp in args.temperature:
        report(engine, args, extra, temp, argv)


def report(engine, args, extra, temp, argv):
    params = SamplingParams(max_tokens=args.max_tokens, temperature=temp, ignore_eos=True)
    stepper = getattr(engine, "async_stepper", None)
    rows = []
    for c in args.concurrency:
        prompts = chat_prompts(engine.tokenizer, c)
        runs = {m: [] for m in args.modes}
        for rep in range(args.repeats):  # round-robin with a rotating order: drift hits every mode alike
            order = args.modes[rep % len(args.modes):] + args.modes[:rep % len(args.modes)]
            for mode in order:
                spec = MODES[mode]
                engine.spec = None if spec is None else build_spec_decoder(
                    engine, parse_speculative(spec.format(kmax=args.kmax) + extra))
                # no-spec runs with the engine's asynchronous scheduling (its best, on by default on CUDA); the
                # speculative step is synchronous, and an engine with an async stepper would bypass it
                if hasattr(engine, "async_stepper"):
                    engine.drain()
                    engine.async_stepper = stepper if spec is None else None
                try:
                    r = run_once(engine, prompts, params)
                except Exception:  # keep measuring the other modes; the failure is in the log
                    traceback.print_exc()
                    for rid in list(engine.seqs):
                        engine.abort_request(rid)
                    continue
                st = engine.spec.stats() if engine.spec is not None else {}
                r.update(acceptance=st.get("spec_acceptance_rate"), mean_len=st.get("spec_mean_accepted_length"))
                runs[mode].append(r)
        for mode in args.modes:
            if not runs[mode]:
                continue
            rs = sorted(runs[mode], key=lambda x: x["wall_s"])
            r = dict(rs[len(rs) // 2], mode=mode, concurrency=c, all_wall_s=[round(x["wall_s"], 3) for x in runs[mode]])
            rows.append(r)
            print(f"c={c:3d} {mode:7s} per-user {r['per_user_tok_s']:8.1f} tok/s  aggregate {r['aggregate_tok_s']:8.1f} "
                  f"tok/s  wall {r['wall_s']:6.2f}s  accept {r['acceptance'] if r['acceptance'] is not None else '-'}"
                  f"  mean_len {r['mean_len'] if r['mean_len'] is not None else '-'}  steps {r['steps']}", flush=True)
    engine.spec = None
    if hasattr(engine, "async_stepper"):
        engine.async_stepper = stepper

    lines = ["| conc | mode | per-user tok/s | aggregate tok/s | per-user vs no-spec | aggregate vs no-spec | "
             "per-user vs k=1 | acceptance rate | mean accepted length (tokens/verify) | wall s (median) | all walls s | tokens | "
             "engine steps |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next((b for b in rows if b["concurrency"] == r["concurrency"] and b["mode"] == "nospec"), None)
        k1 = next((b for b in rows if b["concurrency"] == r["concurrency"] and b["mode"] == "k1"), None)
        f = lambda x: "-" if x is None else f"{x:.3f}"
        lines.append(f"| {r['concurrency']} | {r['mode']} | {r['per_user_tok_s']:.1f} | {r['aggregate_tok_s']:.1f} | "
                     f"{f(base and r['per_user_tok_s'] / base['per_user_tok_s'])} | "
                     f"{f(base and r['aggregate_tok_s'] / base['aggregate_tok_s'])} | "
                     f"{f(k1 and r['per_user_tok_s'] / k1['per_user_tok_s'])} | {f(r['acceptance'])} | "
                     f"{f(r['mean_len'])} | {r['wall_s']:.2f} | {r['all_wall_s']} | {r['tokens']} | {r['steps']} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        with open(args.out, "a") as f:
            f.write(f"\n## {dev} — {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}\n\n"
                    f"Model: {engine.model_name}{' (DUMMY random weights)' if args.load_format == 'dummy' else ''}, dtype {args.dtype}, drafter {args.drafter}, temperature {temp}, greedy={temp == 0}, "
                    f"max_tokens {args.max_tokens} (ignore_eos), prefix caching off, torch {torch.__version__}.\n\n"
                    f"Command: `python bench/spec_decode.py {' '.join(sys.argv[1:] if argv is None else argv)}`\n\n"
                    f"{table}\n")


if __name__ == "__main__":
    main()
