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
from kestrel.spec.decoder import SpecDecoder  # noqa: E402
from kestrel.spec.factory import build_drafter, spec_loop, verify_graphs  # noqa: E402
from kestrel.spec.train_cli import DEFAULT_PROMPTS  # noqa: E402

MODES = {"nospec": None, "k1": "schedule=fixed,k=1", "k4": "schedule=fixed,k=4", "k6": "schedule=fixed,k=6",
         "k8": "schedule=fixed,k=8", "conf": "schedule=confidence,k={kmax}",
         # draft-tree verification (kestrel/spec/tree.py; head drafters): always the tree / the cost model's pick of
         # tree, chain or off per step
         "tree": "schedule=fixed,k={kmax},tree={tree}", "tree-conf": "schedule=confidence,k={kmax},tree={tree}"}

_PASSAGES = [
    "The city council met on Tuesday to discuss the new park. Residents asked for more trees, a playground and "
    "better lighting along the paths. The council agreed to plant two hundred trees next spring and to review the "
    "lighting plan before the end of the year.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make glucose "
    "and oxygen. It takes place mainly in the leaves, inside small structures called chloroplasts, which contain "
    "the green pigment chlorophyll.",
    "Our team shipped the new search feature last week. Queries are now twice as fast, results are ranked by "
    "relevance instead of date, and users can filter by author and by tag. Next we will add spelling correction.",
    "The old lighthouse stood on a rock at the edge of the bay. Every night the keeper climbed the narrow stairs, "
    "lit the lamp and watched the ships pass. One winter night a storm broke the glass, and he kept the flame "
    "alive with his own coat.",
    "To make bread, mix flour, water, salt and yeast into a dough. Knead it for ten minutes, let it rise for an "
    "hour, shape it into a loaf, let it rise again and bake it at two hundred degrees for thirty minutes.",
    "def add_item(cart, item, price):\n    cart['items'].append(item)\n    cart['total'] = cart['total'] + price\n"
    "    return cart\n\ndef remove_item(cart, item, price):\n    cart['items'].remove(item)\n"
    "    cart['total'] = cart['total'] - price\n    return cart",
]
_TASKS = ["Rewrite the following text in a more formal tone:\n\n{}", "Summarize the following text:\n\n{}",
          "Fix any grammar mistakes and repeat the text:\n\n{}", "Continue the following text:\n\n{}"]
# workloads: `chat` = open questions NOT in the head's training prompts (held out); `edit` = rewrite / summarise /
# repeat / continue a given passage (prompt lookup has text to copy)
WORKLOADS = {
    "chat": ["What is the capital of Australia and why was it chosen?", "Explain how a bicycle stays upright.",
             "Write a short poem about the moon.", "What are good habits for learning a new language?",
             "How does a refrigerator keep food cold?", "Describe the rules of basketball.",
             "Write a short story about a dragon who is afraid of fire.", "What is the difference between a virus "
             "and a bacterium?", "Give me three ideas for a birthday party.", "How do airplanes fly?",
             "Explain what a database index is.", "Why do leaves change color in autumn?",
             "Write a thank-you note to a teacher.", "What is the stock market?", "How do I start running?",
             "Explain the difference between weather and climate."],
    "edit": [t.format(p) for p in _PASSAGES for t in _TASKS],
}


def chat_prompts(tok, n: int, offset: int = 0, texts: list[str] | None = None) -> list[list[int]]:
    texts = texts or DEFAULT_PROMPTS
    out = []
    for i in range(n):
        t = texts[(i + offset) % len(texts)]
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
    out, finish, first = {}, {}, {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id not in first and o.output_token_ids:  # time to first token: prefill + entry
                first[o.request_id] = time.perf_counter()
            if o.finished:
                finish[o.request_id] = time.perf_counter()
                out[o.request_id] = list(o.output_token_ids)
    if engine.config.device.startswith("cuda"):
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    ntok = {r: len(out[r]) for r in rids}
    per_user = [ntok[r] / (finish[r] - start[r]) for r in rids]
    ttft = [(first.get(r, finish[r]) - start[r]) * 1e3 for r in rids]
    # the decode phase alone (what speculation changes): tokens after the first over the time after it
    dec = [(ntok[r] - 1) / max(finish[r] - first.get(r, start[r]), 1e-9) for r in rids]
    return {"wall_s": wall, "tokens": sum(ntok.values()), "steps": engine.num_steps - steps0,
            "per_user_tok_s": sum(per_user) / len(per_user), "aggregate_tok_s": sum(ntok.values()) / wall,
            "ttft_ms": sum(ttft) / len(ttft), "decode_tok_s": sum(dec) / len(dec), "outputs": [out[r] for r in rids]}


def run_each(engine, prompts, params) -> dict:
    """Concurrency 1 over several prompts: one request at a time, each alone in the engine. per-user tok/s = the
    mean over prompts (one prompt's 128 tokens are a noisy sample of a drafter's acceptance: session 3 measured
    C=1 on the first chat prompt only)."""
    rs = [run_once(engine, [p], params) for p in prompts]
    wall = sum(r["wall_s"] for r in rs)
    tokens = sum(r["tokens"] for r in rs)
    return {"wall_s": wall, "tokens": tokens, "steps": sum(r["steps"] for r in rs),
            "per_user_tok_s": sum(r["per_user_tok_s"] for r in rs) / len(rs), "aggregate_tok_s": tokens / wall,
            "ttft_ms": sum(r["ttft_ms"] for r in rs) / len(rs), "decode_tok_s": sum(r["decode_tok_s"] for r in rs) / len(rs),
            "outputs": [o for r in rs for o in r["outputs"]]}


@torch.inference_mode()
def tie_report(engine, prompts, outs, ref) -> str:
    """Where a greedy speculative output first differs from the no-spec one: the target's logits there, recomputed
    by a third path (one packed causal forward of prompt + the common prefix, train_draft.collect_hidden): the
    top-1 - top-2 gap and the gap between the two runs' tokens. Both tokens in the top 2 with a gap below the
    dtype's rounding = a near-tie that the verify (K+1 rows) and decode (1 row) forwards round differently; a wide
    gap would be a bug."""
    from kestrel.spec.train_draft import collect_hidden
    gaps, pair, top2 = [], [], 0
    for p, a, b in zip(prompts, outs, ref):
        t = _prefix(a, b)
        if t >= min(len(a), len(b)):
            continue
        h = collect_hidden(engine.model, [list(p) + list(b[:t])], engine.config.device, progress=False,
                           max_tokens=1 << 16, dtype=engine.model.embed_tokens.weight.dtype)[0][-1:]
        lg = (h.float() @ engine.model.lm_head.weight.float().t())[0]  # fp32 logits of the (model-dtype) state
        top = lg.max()
        gaps.append(max(top - lg[a[t]], top - lg[b[t]]).item())  # how far the worse of the two is from the best
        pair.append(abs(lg[a[t]] - lg[b[t]]).item())
        top2 += int(sorted(lg.topk(2).indices.tolist()) == sorted({a[t], b[t]}))
    if not gaps:
        return "no divergence"
    srt, g = sorted(pair), sorted(gaps)
    return (f"{len(gaps)} divergences; fp32 logits of a recomputed state there: |logit(spec token) - logit(no-spec "
            f"token)| median {srt[len(srt) // 2]:.4f} max {srt[-1]:.4f}; worse token below the top logit median "
            f"{g[len(g) // 2]:.4f} max {g[-1]:.4f}; the two tokens are the recomputed top 2 in {top2}/{len(gaps)}")


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target model (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer dir to use instead of the model's (e.g. a "
                    "machine without the embedded GGUF's cached tokenizer)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                    help="dummy = random weights of the model's shape (times the machinery; acceptance is meaningless)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--drafter", nargs="+", default=["ngram"],
                    choices=["ngram", "head", "hybrid", "head-fused", "hybrid-fused"],
                    help="one or more drafters; each runs k1/k4/conf against the same no-spec baseline; hybrid = the "
                         "head, with the n-gram's draft where an n-gram of >= 2 tokens matched (overlapped loop only; "
                         "its -sync modes are the plain head); -fused = the same with the fused drafting kernels "
                         "(head_fused.py, CUDA; the engine's default), side by side with the PyTorch ones (head, "
                         "hybrid: head_fused=0) in this process")
    ap.add_argument("--head", default=None, help="draft head safetensors (for --drafter head)")
    ap.add_argument("--kmax", type=int, default=4, help="most draft tokens for the confidence scheduler")
    ap.add_argument("--tree", nargs="+", default=["4-2-1-1-1-1"],
                    help="draft-tree widths per level for the tree modes (several: one mode each, named by the widths)")
    ap.add_argument("--token-budget", type=int, default=None, help="confidence scheduler budget (default: config's)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0], help="one table per temperature (0 = greedy)")
    ap.add_argument("--workloads", nargs="+", default=["chat"], choices=list(WORKLOADS) + ["train"],
                    help="prompt sets, one table each (train = the head's training prompts)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--c1-prompts", type=int, default=1,
                    help="concurrency 1: run this many prompts one after another (each alone) and average per-user "
                         "tok/s over them (default 1: the first prompt only, as sessions 1-3)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per (mode, concurrency); the median is reported")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="engine's async scheduling for the no-spec runs (default: the engine's auto, on for CUDA)")
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="CUDA graphs for decode, verify and the draft head (--no-cuda-graphs: all eager)")
    ap.add_argument("--loop", nargs="+", default=["auto"], choices=["auto", "off"],
                    help="speculative step: auto = the overlapped device loop where it applies (spec_loop.py), off = "
                         "the synchronous step; both = each speculative mode twice (off ones named *-sync)")
    ap.add_argument("--sync-modes", nargs="*", default=[], choices=[m for m in MODES if MODES[m]],
                    help="speculative modes to run also through the synchronous step (named *-sync)")
    ap.add_argument("--spec-args", default="", help="extra SpeculativeConfig fields for every speculative mode, "
                    "e.g. 'hybrid_ngram=2' (the head drafter's loop copies where an n-gram of >= 2 tokens matches)")
    ap.add_argument("--buckets", type=int, nargs="+", default=None,
                    help="CUDA-graph batch buckets (default: the engine's; fewer = shorter start-up)")
    ap.add_argument("--tie-check", action="store_true",
                    help="greedy: at each first divergence from no-spec, recompute the target's logits (tie_report)")
    ap.add_argument("--prefill-graphs", action="store_true",
                    help="also capture the engine's prefill CUDA graphs (kestrel/engine/prefill_graphs.py) and run "
                         "every mode twice in this process: eager prefill, and prefill from the graphs (named *+pg)")
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--out", default=None, help="append a markdown section with the results to this file")
    args = ap.parse_args(argv)
    if any(d != "ngram" for d in args.drafter) and not args.head:
        ap.error("--drafter head needs --head FILE (train one with `kestrel train-draft`)")
    if args.tokenizer:
        import kestrel.model.loader as loader
        from transformers import AutoTokenizer
        loader.load_tokenizer = lambda kind, path: AutoTokenizer.from_pretrained(args.tokenizer)
        if args.model is None and args.load_format == "dummy":  # no embedded GGUF needed for random weights
            loader.resolve = lambda model: ("hf", args.tokenizer, "dummy")

    if args.buckets:
        import kestrel.engine.cuda_graphs as cg
        cg.default_batch_buckets = lambda max_num_seqs: sorted(set(args.buckets))
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
                                    max_num_seqs=max(args.concurrency), kv_cache_gb=args.kv_cache_gb,
                                    enable_prefix_caching=False, max_num_batched_tokens=4096, progress=False,
                                    async_scheduling=args.async_scheduling, cuda_graphs=args.cuda_graphs))
    print(f"engine ready in {time.perf_counter() - t0:.1f}s", flush=True)
    if args.prefill_graphs:
        t0 = time.perf_counter()
        try:  # a failed capture must not cost the eager measurements
            engine.runner.enable_prefill_graphs(engine.max_model_len)
            from kestrel.engine.prefill_graph_check import summary
            print(summary(engine.runner.prefill_graph_report), flush=True)
            if engine.runner.prefill_graphs is None:
                raise RuntimeError("every prefill graph bucket failed its self-check")
            print(f"prefill graphs {engine.runner.prefill_graphs.buckets} ready in {time.perf_counter() - t0:.1f}s",
                  flush=True)
        except Exception:
            traceback.print_exc()
            engine.runner.prefill_graphs, args.prefill_graphs = None, False
    run_once(engine, chat_prompts(engine.tokenizer, 2), SamplingParams(max_tokens=8, temperature=0))  # warm-up
    t0 = time.perf_counter()
    decoders = build_modes(engine, args)
    print(f"speculative decoders (verify/head graphs) ready in {time.perf_counter() - t0:.1f}s", flush=True)
    for temp in args.temperature:
        for wl in args.workloads:
            report(engine, args, decoders, temp, wl, argv)


def build_modes(engine, args) -> dict:
    """mode name -> factory of a fresh SpecDecoder (None = no-spec). A draft head is loaded (and its graphs
    captured) once and shared by its modes; n-gram drafters are per run (they adapt per request)."""
    modes = {"nospec": None} if "nospec" in args.modes else {}
    budget = f",token_budget={args.token_budget}" if args.token_budget else ""
    # the draft head is loaded (and its graphs captured) once for the head and hybrid drafters, once more for the
    # fused ones (another drafter object: the loop cache keys on it, so the two variants get their own graphs)
    heads = {}
    runs = [(m, lp) for lp in args.loop for m in args.modes if MODES[m] is not None and
            not (m.startswith("tree") and (lp == "off" or args.drafter == ["ngram"]))]
    runs += [(m, "off") for m in args.sync_modes if "off" not in args.loop]
    for d in args.drafter:
        base, fused = d.removesuffix("-fused"), d.endswith("-fused")
        for m0, lp in [(m + (f"@{w}" if len(args.tree) > 1 else ""), lp) if m.startswith("tree") else (m, lp)
                       for m, lp in runs for w in (args.tree if m.startswith("tree") else [None])]:
            m, tree = m0.split("@")[0], m0.split("@")[1] if "@" in m0 else args.tree[0]
            if d == "ngram" and m.startswith("tree"):
                continue
            extra = (",hybrid_ngram=2" if base == "hybrid" else "") + (",head_fused=1" if fused else ",head_fused=0")
            cfg = parse_speculative(MODES[m].format(kmax=args.kmax, tree=tree) + f",drafter={'ngram' if d == 'ngram' else 'head'}"
                                    + budget + f",loop={lp}" + extra + (f",{args.spec_args}" if args.spec_args else "")
                                    + (f",head={args.head}" if d != "ngram" else ""))
            if d != "ngram" and fused not in heads:
                heads[fused] = build_drafter(cfg, engine)

            def make(cfg=cfg, shared=heads.get(fused) if d != "ngram" else None):
                dec = SpecDecoder(cfg, shared or build_drafter(cfg, engine), engine.config.device)
                if args.cuda_graphs:
                    dec.graphs = verify_graphs(engine, max(cfg.k, args.kmax))
                    dec.loop = spec_loop(engine, cfg, dec.drafter)
                return dec
            make()  # capture now, not inside a timed run
            name = f"{d}-{m0}" if len(args.drafter) > 1 or d != "ngram" else m0
            modes[name + ("-sync" if lp == "off" and (len(args.loop) > 1 or lp not in args.loop) else "")] = make
    if args.prefill_graphs:  # the same decoders, prefill from the engine's prefill graphs
        modes.update({name + "+pg": make for name, make in list(modes.items())})
    return modes


def report(engine, args, decoders, temp, workload, argv):
    params = SamplingParams(max_tokens=args.max_tokens, temperature=temp, ignore_eos=True)
    stepper = getattr(engine, "async_stepper", None)
    texts = DEFAULT_PROMPTS if workload == "train" else WORKLOADS[workload]
    rows = []
    names = list(decoders)
    for c in args.concurrency:
        each = c == 1 and args.c1_prompts > 1
        prompts = chat_prompts(engine.tokenizer, args.c1_prompts if each else c, texts=texts)
        runs = {m: [] for m in names}
        for rep in range(args.repeats):  # round-robin with a rotating order: drift hits every mode alike
            order = names[rep % len(names):] + names[:rep % len(names)]
            for mode in order:
                make = decoders[mode]
                engine.spec = None if make is None else make()
                if args.prefill_graphs:  # only the +pg modes prefill from the graphs
                    engine.runner.use_prefill_graphs = mode.endswith("+pg")
                # no-spec runs with the engine's asynchronous scheduling (its best, on by default on CUDA); the
                # speculative step is synchronous, and an engine with an async stepper would bypass it
                if hasattr(engine, "async_stepper"):
                    engine.drain()
                    engine.async_stepper = stepper if make is None else None
                try:
                    r = (run_each if each else run_once)(engine, prompts, params)
                except Exception:  # keep measuring the other modes; the failure is in the log
                    traceback.print_exc()
                    for rid in list(engine.seqs):
                        engine.abort_request(rid)
                    continue
                st = engine.spec.stats() if engine.spec is not None else {}
                r.update(acceptance=st.get("spec_acceptance_rate"), mean_len=st.get("spec_mean_accepted_length"),
                         loop_k=st.get("spec_loop_steps"), loop_ms=st.get("spec_loop_device_ms"),
                         loop_host=st.get("spec_loop_host_ms"))
                runs[mode].append(r)
        ref = runs.get("nospec") and runs["nospec"][0]["outputs"]
        for mode in names:
            if not runs[mode]:
                continue
            rs = sorted(runs[mode], key=lambda x: x["wall_s"])
            r = dict(rs[len(rs) // 2], mode=mode, concurrency=c, all_wall_s=[round(x["wall_s"], 3) for x in runs[mode]])
            # greedy: requests whose tokens equal the no-spec run's (low-precision numerics may flip near-ties)
            # and the mean length of the common prefix (where a flip happens, not just whether)
            pairs = [(a, b) for x in runs[mode] for a, b in zip(x["outputs"], ref)] if ref and temp == 0 else []
            if args.tie_check and ref and temp == 0 and mode != "nospec":
                try:  # a diagnostic: a failure here must not cost the measured table
                    print(f"[{workload}] c={c:3d} {mode:12s} tie check: "
                          f"{tie_report(engine, prompts, runs[mode][0]['outputs'], ref)}", flush=True)
                except Exception:
                    traceback.print_exc()
            r["same"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)} ({sum(_prefix(a, b) for a, b in pairs) / len(pairs):.0f})" \
                if pairs else None
            rows.append(r)
            print(f"[{workload}] c={c:3d} {mode:12s} per-user {r['per_user_tok_s']:8.1f} tok/s  aggregate "
                  f"{r['aggregate_tok_s']:8.1f} tok/s  wall {r['wall_s']:6.2f}s  accept "
                  f"{r['acceptance'] if r['acceptance'] is not None else '-'}  mean_len "
                  f"{r['mean_len'] if r['mean_len'] is not None else '-'}  steps {r['steps']}  ttft {r['ttft_ms']:.2f} ms  decode-phase per-user "
                  f"{r['decode_tok_s']:.1f} tok/s  "
                  f"same {r['same']}  "
                  f"loop K steps {r['loop_k']}",
                  flush=True)
    engine.spec = None
    if hasattr(engine, "async_stepper"):
        engine.async_stepper = stepper

    lines = ["| conc | mode | per-user tok/s | aggregate tok/s | per-user vs no-spec | aggregate vs no-spec | "
             "per-user vs k=1 | acceptance rate | mean accepted length (tokens/verify) | wall s (median) | all walls s | "
             "tokens | engine steps | same tokens as no-spec (mean common prefix) | loop steps per K | "
             "loop device ms per step (bucket x K) | loop host ms/step | time to first token ms (mean) | "
             "decode-phase per-user tok/s (after the first token) | decode-phase vs no-spec |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        # +pg modes against no-spec with the same (graph) prefill: both sides of a ratio prefill alike
        bname = "nospec+pg" if r["mode"].endswith("+pg") and any(b["mode"] == "nospec+pg" for b in rows) else "nospec"
        base = next((b for b in rows if b["concurrency"] == r["concurrency"] and b["mode"] == bname), None)
        mode, sync = (r["mode"][:-5], "-sync") if r["mode"].endswith("-sync") else (r["mode"], "")
        k1name = (mode.rsplit("-", 1)[0] + "-k1" if "-" in mode else "k1") + sync
        k1 = next((b for b in rows if b["concurrency"] == r["concurrency"] and b["mode"] == k1name), None)
        f = lambda x: "-" if x is None else f"{x:.3f}"
        lines.append(f"| {r['concurrency']} | {r['mode']} | {r['per_user_tok_s']:.1f} | {r['aggregate_tok_s']:.1f} | "
                     f"{f(base and r['per_user_tok_s'] / base['per_user_tok_s'])} | "
                     f"{f(base and r['aggregate_tok_s'] / base['aggregate_tok_s'])} | "
                     f"{f(k1 and r['per_user_tok_s'] / k1['per_user_tok_s'])} | {f(r['acceptance'])} | "
                     f"{f(r['mean_len'])} | {r['wall_s']:.2f} | {r['all_wall_s']} | {r['tokens']} | {r['steps']} | "
                     f"{r['same'] or '-'} | {r.get('loop_k') or '-'} | {r.get('loop_ms') or '-'} | "
                     f"{f(r.get('loop_host'))} | {r['ttft_ms']:.2f} | {r['decode_tok_s']:.1f} | "
                     f"{f(base and r['decode_tok_s'] / base['decode_tok_s'])} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        with open(args.out, "a") as f:
            f.write(f"\n## {dev} — {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} — workload {workload}\n\n"
                    f"Model: {engine.model_name}{' (DUMMY random weights)' if args.load_format == 'dummy' else ''}, "
                    f"dtype {args.dtype}, drafters {' '.join(args.drafter)}, temperature {temp}, greedy={temp == 0}, "
                    f"max_tokens {args.max_tokens} (ignore_eos), prefix caching off, CUDA graphs {args.cuda_graphs}, "
                    f"torch {torch.__version__}.\n\n"
                    f"Command: `python bench/spec_decode.py {' '.join(sys.argv[1:] if argv is None else argv)}`\n\n"
                    f"{table}\n")


if __name__ == "__main__":
    main()
