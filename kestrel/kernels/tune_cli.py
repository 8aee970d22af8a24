"""`kestrel tune`: autotune the WNA16 GEMM for given formats/shapes on this GPU and store the winners."""
from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    from kestrel.kernels.tuning import FORMATS, MODEL_SHAPES  # light: no torch.cuda work at import
    p = subparsers.add_parser(
        "tune", help="autotune quantized GEMM kernels on this GPU",
        description="Measure candidate compute configs (tile sizes, split-K, warps, stages) of the WNA16 GEMM for "
                    "each (format, N, K, M bucket) on the current GPU and store the fastest in the tune cache "
                    "(keyed by GPU name + format + shape). Kernels read it, falling back to heuristics.")
    p.add_argument("--format", dest="formats", action="append", choices=sorted(FORMATS),
                   help="weight format to tune (repeatable; default: int4)")
    p.add_argument("--model", action="append", choices=sorted(MODEL_SHAPES),
                   help="take the (N, K) linear shapes of this model (repeatable)")
    p.add_argument("--shape", action="append", metavar="N,K", help="an extra (N, K) weight shape (repeatable)")
    p.add_argument("--m", default="1,4,16,64,256,1024,4096",
                   help="comma-separated batch sizes M to tune (each stands for its power-of-two bucket)")
    p.add_argument("--cache", default=None,
                   help="cache file to update (default: $KESTREL_TUNE_CACHE or ~/.cache/kestrel/tune.json)")
    p.add_argument("--max-candidates", type=int, default=None,
                   help="measure at most this many candidates per (shape, M), nearest to the heuristic first, to save time")
    p.add_argument("--list", action="store_true", help="only print the candidate counts, measure nothing")
    p.add_argument("--jobs", type=int, default=0,
                   help="first JIT-compile every candidate in this many worker processes (Triton compiles are "
                        "CPU-bound, 5-30 s each, one at a time per process); 0: compile while timing")
    p.add_argument("--record", default=None, metavar="JSONL",
                   help="also append every measured candidate (key, config, us; null = rejected) to this file")
    p.add_argument("--no-gluon", action="store_true",
                   help="leave the Gluon tcg kernel (Hopper) out of the candidates")
    from kestrel.kernels.lowbit_tuning import LOWBIT_KERNELS
    p.add_argument("--lowbit", action="append", choices=sorted(LOWBIT_KERNELS),
                   help="also tune this W8A8 / W4A8 / W4A4 GEMM for the same shapes and M (repeatable; "
                        "without --format only the low-bit kernels are tuned); stored in the low-bit tune cache")
    from kestrel.kernels.moe_tune import MOE_KERNELS, MOE_MODELS
    p.add_argument("--moe", action="append", choices=sorted(MOE_MODELS),
                   help="tune the grouped MoE GEMM (both expert projections) of this model for the --m token counts "
                        "(repeatable); stored in the low-bit tune cache")
    p.add_argument("--moe-kernel", action="append", choices=sorted(MOE_KERNELS),
                   help="which grouped MoE kernel / format to tune with --moe (repeatable; default: moe-int4p)")
    return p


def _parse_shape(s: str) -> tuple[int, int]:
    try:
        n, k = (int(v) for v in s.split(","))
    except ValueError:
        raise ValueError(f"--shape expects N,K (two integers), got {s!r}") from None
    if n <= 0 or k <= 0:
        raise ValueError(f"--shape values must be positive, got {s!r}")
    return n, k


def run(args) -> int:
    from pathlib import Path

    from kestrel.kernels.configs import LayerConfig, store_cache, user_cache_path
    from kestrel.kernels.tuning import FORMATS, MODEL_SHAPES, layer_candidates

    try:
        ms = sorted({int(v) for v in args.m.split(",") if v.strip()})
    except ValueError:
        raise ValueError(f"--m expects comma-separated integers, got {args.m!r}") from None
    if not ms or min(ms) < 1:
        raise ValueError("--m needs at least one batch size >= 1")
    if getattr(args, "moe", None):  # grouped MoE GEMMs (kestrel/kernels/moe_tune.py): model shapes, token counts
        from kestrel.kernels.moe_tune import MOE_MODELS, candidates as moe_candidates, run_cli as moe_run_cli
        kernels = args.moe_kernel or ["moe-int4p"]
        if args.list:
            for model in args.moe:
                E, k, H, I = MOE_MODELS[model]
                for kern in kernels:
                    print(model, kern, {(N, K, m): len(moe_candidates(kern, m, E, k, N, K))
                                        for N, K in ((2 * I, H), (H, I)) for m in ms})
        else:
            moe_run_cli(args.moe, kernels, ms, args.max_candidates)
        if not (args.formats or args.lowbit or args.shape or args.model):
            return 0
    shapes = [_parse_shape(s) for s in (args.shape or [])]
    for model in args.model or []:
        shapes += MODEL_SHAPES[model]
    if not shapes:
        raise ValueError("give at least one --shape N,K or --model")
    if args.lowbit:  # low-bit GEMMs (kestrel/kernels/lowbit_tuning.py) share the shape / M arguments
        from kestrel.kernels.lowbit_tuning import candidates as lowbit_candidates, run_cli
        uniq = list(dict.fromkeys(shapes))
        if args.list:
            for k in args.lowbit:
                print(k, {m: len(lowbit_candidates(k, m, n, kk, args.max_candidates)) for n, kk in uniq for m in ms})
        else:
            run_cli(args.lowbit, uniq, ms, args.max_candidates)
        if not args.formats:
            return 0
    layers = []
    for f in args.formats or ["int4"]:
        for n, k in dict.fromkeys(shapes):
            layer = LayerConfig(FORMATS[f], n, k)
            layers.append(layer)
    gluon = not args.no_gluon
    cands = lambda lay, m: layer_candidates(lay, m, args.max_candidates, gluon)
    total = sum(len(cands(lay, m)) for lay in layers for m in ms)
    if args.list:
        for lay in layers:
            print(lay.key, {m: len(cands(lay, m)) for m in ms})
        print(f"{total} measurements")
        return 0

    import torch
    if not torch.cuda.is_available():
        raise ValueError("kestrel tune needs a CUDA GPU (none is visible)")
    from tqdm import tqdm

    from kestrel.kernels.tuning import tune_layer
    gpu = torch.cuda.get_device_name()
    cache = Path(args.cache) if args.cache else user_cache_path()
    total += len(layers) * len(ms)  # the config in use before is timed too
    if args.jobs:
        from kestrel.kernels.tuning import warm_compile
        warm_compile([(lay, m, c) for lay in layers for m in ms for c in cands(lay, m)], args.jobs)
    record = None
    if args.record:  # appended as measured: a killed run keeps what it timed
        import json
        log = open(args.record, "a")
        record = lambda key, cfg, t: print(json.dumps({"key": key, "config": cfg.to_dict(), "us": round(t, 3)
                                                       if t != float("inf") else None}), file=log, flush=True)
    with tqdm(total=total, desc=f"tuning on {gpu}", unit="cfg") as bar:
        for layer in layers:
            bar.set_postfix_str(layer.key)
            res = tune_layer(layer, ms, gpu, progress=bar, max_candidates=args.max_candidates, gluon=gluon,
                             record=record)
            store_cache(cache, res)
            for key, v in res.items():
                tqdm.write(f"{key}: {v['us']:.1f} us (heuristic {v['heuristic_us']}, previous {v['previous_us']}) "
                           f"{v['config']}")
    print(f"wrote {cache}")
    return 0
