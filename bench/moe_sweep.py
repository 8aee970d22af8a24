"""Grouped MoE GEMM (one projection, int4 g128 W4A16 "halves") compute-config sweep + sort/align timings, one GPU.

For each expert shape and token count M: the up projection [E, N, K] over the slots of M tokens x top-k, every
candidate config (tile, warps, stages, split-K, swapped operands) timed in a CUDA graph rotating over 8 distinct
routings (distinct experts per call, so the L2 does not keep the touched weights warm). Each config's output is
checked against the per-slot fp32 reference on a sample of slots. Effective bandwidth = bytes of the experts that
the routing touches (packed weights + scales) / time. Also times the sort/align implementations.

  python bench/moe_sweep.py --out $OUT/moe_sweep
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from gemm_w8a8 import T0, log, safe_us as graph_safe_us  # noqa: E402

from kestrel.kernels import moe_align as ma  # noqa: E402
from kestrel.kernels.gemm_w4a8 import W4Weight  # noqa: E402
from kestrel.kernels.lowbit_gemm import A_BF16, GemmConfig, Operand  # noqa: E402
from kestrel.kernels.moe_gemm import ExpertWeights, grouped_gemm, moe_config  # noqa: E402
from kestrel.kernels.moe_mv import MvConfig, PlanarW4, grouped_gemm_planar  # noqa: E402
from kestrel.kernels.moe_tc import TcConfig, grouped_gemm_planar_tc  # noqa: E402
from kestrel.quant.packing import unpack_codes  # noqa: E402

try:  # the Gluon grouped kernel (GPU only)
    from kestrel.kernels.moe_tcg import TcgConfig, grouped_gemm_planar_tcg, supports as tcg_supports
    from kestrel.kernels.moe_tcg import compiled_stats as tcg_stats
except Exception as _ex:  # noqa: BLE001
    TcgConfig = None
    TCG_IMPORT_ERROR = repr(_ex)

DEV = os.environ.get("SWEEP_DEVICE", "cuda")


def safe_us(fns):
    if DEV != "cpu":
        return graph_safe_us(fns)
    for f in fns:  # CPU smoke test of the script: each call runs once, no timing
        f()
    return 1.0


SHAPES = {  # name -> experts, top_k, N (2 x moe intermediate), K (hidden)
    "tiny": (4, 2, 64, 256),  # CPU smoke test of this script (SWEEP_DEVICE=cpu, TRITON_INTERPRET=1)
    "qwen3-30b-a3b": (128, 8, 1536, 2048),
    "mixtral-8x7b": (8, 2, 28672, 4096),
    "deepseek-v3": (256, 8, 4096, 7168),
    # down projections [E, H, I] (the sweep feeds them tokens, not slots: the weight stream is the same)
    "qwen3-30b-a3b-down": (128, 8, 2048, 768),
    "mixtral-8x7b-down": (8, 2, 4096, 14336),
    "deepseek-v3-down": (256, 8, 7168, 2048),
}


def C(bm, bn, w, st, sk=1, swap=0):
    return GemmConfig(BM=bm, BN=bn, BK=128, SPLIT_K=sk, num_warps=w, num_stages=st, SWAP_AB=swap)


# R1 (bench/results/moe_h200_run4.md) swept the byte-packed kernel's tiles; two best kept as the reference
DECODE = [C(16, 128, 4, 4), C(16, 128, 4, 4, 1, 1)]
LARGE = [C(64, 128, 4, 4, 1, 1), C(128, 128, 8, 3, 1, 1)]
# the planar-int4 kernel (moe_mv.py): WNA16 decode's "mv" K loop; R2 candidates around R1's winners
M_ = MvConfig
PDECODE = [M_(16, 128, 4, 2, 3), M_(16, 64, 4, 2, 3), M_(16, 128, 2, 2, 3), M_(16, 128, 2, 2, 4), M_(16, 128, 1, 2, 3),
           M_(16, 32, 4, 2, 3), M_(16, 64, 8, 2, 3), M_(16, 64, 4, 1, 3), M_(16, 128, 4, 1, 3), M_(16, 64, 2, 2, 3),
           M_(16, 128, 1, 1, 3), M_(16, 256, 2, 4, 3)]
PLARGE = [M_(64, 128, 1, 4, 3, 1), M_(64, 128, 1, 8, 3, 1), M_(128, 128, 1, 8, 3, 1), M_(64, 256, 1, 8, 3, 1),
          M_(128, 256, 1, 8, 3, 1), M_(64, 128, 1, 4, 4, 1), M_(64, 128, 1, 4, 3, 1, 2), M_(32, 128, 1, 4, 3, 1),
          M_(32, 128, 1, 4, 3, 0), M_(128, 128, 1, 4, 3, 1), M_(64, 64, 1, 4, 3, 1), M_(32, 64, 1, 4, 3, 1)]


# the planar-int4 tc kernel (moe_tc.py): one K=128 dot per step; large M only (>= 32 rows per expert block)
T_ = TcConfig
TLARGE = [T_(64, 128, 4, 3, 0, 1), T_(64, 128, 4, 3, 1, 1), T_(128, 128, 8, 3, 0, 2), T_(128, 128, 8, 3, 0, 1),
          T_(64, 128, 8, 3, 0, 2), T_(128, 256, 8, 3, 0, 1), T_(128, 64, 4, 3, 0, 1), T_(64, 256, 8, 3, 0, 1),
          T_(128, 128, 8, 4, 0, 2), T_(64, 128, 4, 4, 0, 1), T_(128, 128, 8, 2, 0, 2), T_(128, 128, 8, 3, 1, 1)]


# the Gluon tcg kernel (moe_tcg.py): BM:BN:warps:stages:GROUP_M:SWAP[:REFILL[:MAXNREG]]
TCG = ("64:256:8:3:8:1,64:256:8:2:8:1,64:256:8:4:8:1,32:256:8:3:8:1,"
       "64:256:8:3:0:1,64:256:8:3:16:1,32:128:8:3:8:1")


def random_w4(E, N, K, gen_seed=0):
    g = torch.Generator(device=DEV).manual_seed(gen_seed)
    packed = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device=DEV, generator=g)
    scale = torch.rand(E, N, K // 128, device=DEV, generator=g) * 0.02 + 0.001
    return ExpertWeights("int4", w4=W4Weight("int4", packed, scale, 128, layout="halves"))


def random_planar(E, N, K, gen_seed=1):
    g = torch.Generator(device=DEV).manual_seed(gen_seed)
    qw = torch.randint(-2**31, 2**31 - 1, (E, K // 8, N), dtype=torch.int32, device=DEV, generator=g)
    scale = torch.rand(E, K // 128, N, device=DEV, generator=g) * 0.02 + 0.001
    return PlanarW4(qw, scale, 128)


def ref_rows_planar(x, P: PlanarW4, ids, slots, k):
    K = x.shape[1]
    out = []
    for t in slots:
        e = int(ids.reshape(-1)[t])
        we = (unpack_codes(P.qweight[e], 4, K) - 8).float() * P.scales[e].t().repeat_interleave(128, dim=1)
        out.append(x[t // k].float() @ we.t())
    return torch.stack(out)


def ref_all_planar(x, P: PlanarW4, ids, k):
    """fp32 reference of every slot [T, N], one expert at a time (the sampled rows above miss most tiles: a
    persistent kernel's later tiles need the whole output checked)."""
    K = x.shape[1]
    flat = ids.reshape(-1)
    out = torch.zeros(flat.numel(), P.shape[1], device=x.device)
    for e in torch.unique(flat).tolist():
        sl = torch.nonzero(flat == e).squeeze(1)
        we = (unpack_codes(P.qweight[e], 4, K) - 8).float() * P.scales[e].t().repeat_interleave(128, dim=1)
        out[sl] = x[sl // k].float() @ we.t()
    return out


def routing(M, E, k, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.rand(M, E, device=DEV, generator=g).topk(k, dim=-1).indices.to(torch.int32)


def ref_rows(x, W: ExpertWeights, ids, slots, k):
    """fp32 reference rows for the sampled slots: x[t // k] @ dequant(W[e])^T."""
    w4 = W.w4
    out = []
    for t in slots:
        e = int(ids.reshape(-1)[t])
        we = W4Weight("int4", w4.packed[e], w4.scale[e], 128, layout="halves").dequantize()
        out.append(x[t // k].float() @ we.t())
    return torch.stack(out)


def humming_up(E, N, K):
    """Humming's int4 g128 W4A16 MoE layer for one projection [E, N, K] (JIT: ~10 s)."""
    from humming.layer import HummingLayer
    L = HummingLayer(shape_n=N, shape_k=K, weight_config={"dtype": "int4", "group_size": 128}, input_config=None,
                     num_experts=E, torch_dtype=torch.bfloat16).cuda()
    L.load_from_unquantized(torch.randn(E, N, K, device=DEV, dtype=torch.bfloat16) * 0.02)
    L.transform()
    return L


def humming_call(L, x, ids, E, k):
    """Humming's indexed grouped GEMM for this routing; its metadata is built here, outside the timed call."""
    from humming.testing.data import generate_moe_tensors
    from humming.tune import get_heuristics_config
    M = x.shape[0]
    cfg = get_heuristics_config(L.humming_config, shape_m=M * k, gemm_type="indexed")
    _, _, sid, eid, npad = generate_moe_tensors(ids, E, "indexed", cfg["block_shape"][0])
    def run():
        return L(x, sorted_ids=sid, expert_ids=eid, num_tokens_padded=npad, top_k=k,
                 compute_config={"gemm_type": "indexed"}, tuning_config=cfg)
    run.cfg = {k_: v if isinstance(v, (int, float, str, bool, list, tuple, type(None))) else str(v)
               for k_, v in cfg.items()}  # its heuristic's tile / schedule, to compare with ours
    return run


SAVE = [None]


def sweep_shape(name, ms, rows, args):
    E, k, N, K = SHAPES[name]
    W = random_w4(E, N, K)
    P = random_planar(E, N, K)
    hum = None
    if name in args.humming.split(",") and time.time() - T0 < args.humming_by_s:
        try:
            t = time.time()
            hum = humming_up(E, N, K)
            log(f"  humming layer ready ({time.time() - t:.1f}s)")
        except Exception:
            traceback.print_exc()
    wbytes_per_expert = N * K // 2 + N * (K // 128) * 4
    log(f"== {name}: E={E} top{k} N={N} K={K} ({E * wbytes_per_expert / 1e9:.2f} GB int4)")
    for M in ms:
        T = M * k
        x = torch.randn(M, K, device=DEV).to(torch.bfloat16)
        a = Operand(A_BF16, x)
        idss = [routing(M, E, k, s) for s in range(8)]
        touched = sum(int(torch.unique(i).numel()) for i in idss) / len(idss)
        nbytes = touched * wbytes_per_expert
        kernels = args.kernels.split(",")
        cfgs = DECODE if T / E <= 16 else LARGE
        default = moe_config(T, E, "bf16")
        if default not in cfgs:
            cfgs = [default] + cfgs
        cfgs = cfgs if "lowbit" in kernels else []
        tl_ = [T_(*(int(v) for v in c.split(":"))) for c in args.tc.split(",")] if args.tc else TLARGE
        tcfgs = tl_[:args.max_tc] if "tc" in kernels and T / E > 16 else []
        gcfgs = ([TcgConfig(*(int(v) for v in c.split(":"))) for c in args.tcg.split(",")]
                 if "tcg" in kernels and T / E > 16 and TcgConfig is not None else [])
        slots = torch.randperm(T)[:16].tolist()
        ref = ref_rows(x, W, idss[0], slots, k)
        bms = sorted({c.BM for c in cfgs})
        aligns = {bm: [ma.moe_align(i, E, bm) for i in idss] for bm in bms}
        pcfgs = (PDECODE if T / E <= 16 else PLARGE)[:args.max_planar] if "planar" in kernels else []
        pref = ref_rows_planar(x, P, idss[0], slots, k)
        full = ref_all_planar(x, P, idss[0], k) if gcfgs else None
        for bm in {c.BM for c in pcfgs + tcfgs + gcfgs} - set(aligns):
            aligns[bm] = [ma.moe_align(i, E, bm) for i in idss]

        def measure(r, launch, want, want_all=None):
            """Check launch(i, out) (routing i) against the float64 reference rows (want_all: every slot), then time
            it over the routings."""
            try:
                outs = [torch.full((T, N), float("nan"), device=DEV, dtype=torch.bfloat16) for _ in idss]
                launch(0, outs[0])
                r["err"] = ((outs[0][slots].float() - want).norm() / want.norm()).item()
                if want_all is not None:  # nan-filled: a slot the kernel never wrote shows as nan
                    r["err_all"] = ((outs[0].float() - want_all).norm() / want_all.norm()).item()
                r["us"] = safe_us([lambda i=i: launch(i, outs[i]) for i in range(len(idss))])
                if r["us"]:
                    r["GBps"] = round(nbytes / r["us"] / 1e3, 1)
            except Exception as ex:
                traceback.print_exc()
                r["error"] = repr(ex)[:300]
            rows.append(r)
            log("ROW", json.dumps(r))

        for cfg in pcfgs:
            r = {"shape": name, "M": M, "E": E, "top_k": k, "N": N, "K": K, "kernel": "planar", "cfg": cfg.as_dict(),
                 "touched_experts": touched}
            measure(r, lambda i, out, cfg=cfg: grouped_gemm_planar(x, P, aligns[cfg.BM][i], T, k, out, cfg), pref)
        for cfg in gcfgs:  # first: the new kernel's numbers are the ones a time-boxed run must return
            r = {"shape": name, "M": M, "E": E, "top_k": k, "N": N, "K": K, "kernel": "tcg", "cfg": cfg.as_dict(),
                 "touched_experts": touched, "supported": tcg_supports(x, P, cfg)}
            measure(r, lambda i, out, cfg=cfg: grouped_gemm_planar_tcg(x, P, aligns[cfg.BM][i], T, k, out, cfg), pref,
                    full)
            log("  tcg", cfg.as_dict(), tcg_stats())
            if time.time() - T0 > args.deadline_s:
                log("deadline: stopping the tcg configs")
                break
        for cfg in tcfgs:
            r = {"shape": name, "M": M, "E": E, "top_k": k, "N": N, "K": K, "kernel": "tc", "cfg": cfg.as_dict(),
                 "touched_experts": touched}
            measure(r, lambda i, out, cfg=cfg: grouped_gemm_planar_tc(x, P, aligns[cfg.BM][i], T, k, out, cfg), pref)
            if time.time() - T0 > args.deadline_s:
                log("deadline: stopping the tc configs")
                break
        for cfg in cfgs:
            r = {"shape": name, "M": M, "E": E, "top_k": k, "N": N, "K": K, "cfg": cfg.as_dict(),
                 "default": cfg == default, "touched_experts": touched, "kernel": "lowbit"}
            measure(r, lambda i, out, cfg=cfg: grouped_gemm(a, W, aligns[cfg.BM][i], T, k, out, cfg), ref)
        if hum is not None:
            r = {"shape": name, "M": M, "E": E, "top_k": k, "N": N, "K": K, "peer": "humming_int4"}
            try:
                t = time.time()
                runs = [humming_call(hum, x, i, E, k) for i in idss]
                r["cfg"] = runs[0].cfg
                r["us"] = safe_us(runs)
                if r["us"]:
                    r["GBps"] = round(nbytes / r["us"] / 1e3, 1)
                log(f"  humming M={M} ({time.time() - t:.1f}s)")
            except Exception as ex:
                traceback.print_exc()
                r["error"] = repr(ex)[:300]
            rows.append(r)
            log("ROW", json.dumps(r))
        if SAVE[0]:
            SAVE[0]()  # after every M: a time-boxed run keeps what it measured
        for kern in ("lowbit", "planar", "tc", "tcg", None):
            best = min((r for r in rows if r.get("shape") == name and r["M"] == M and r.get("us") and
                        r.get("kernel") == kern), key=lambda r: r["us"], default=None)
            if best:
                log(f"BEST {name} M={M} {kern or 'humming'}: {best['us']:.1f} us {best.get('GBps')} GB/s "
                    f"{best.get('cfg')}")


def align_equivalent(got, want, ids, bm) -> bool:
    """same block experts, num_post and padding positions; every slot once, in a block of its own expert."""
    s, e, n = got
    T = ids.numel()
    valid = s < T
    blk_e = e.repeat_interleave(bm)
    return bool(torch.equal(e, want[1]) and torch.equal(n, want[2]) and torch.equal(valid, want[0] < T)
                and torch.equal(s.sort().values, want[0].sort().values)
                and (ids.reshape(-1)[s[valid].long()] == blk_e[valid]).all())


def align_timings(rows):
    for E, k in ((8, 2), (128, 8), (256, 8)) if DEV == "cuda" else ((4, 2),):
        for M in (1, 64, 256, 1024, 4096) if DEV == "cuda" else (1, 5):
            T = M * k
            idss = [routing(M, E, k, s) for s in range(4)]
            bm = moe_config(T, E, "bf16").BM
            r = {"align": True, "E": E, "top_k": k, "M": M, "BM": bm}
            for impl, fn in (("torch", ma.moe_align_torch), ("default", ma.moe_align),
                             ("fast", getattr(ma, "moe_align_fast", None))):
                if fn is None:
                    continue
                try:
                    if impl != "torch":
                        r[f"{impl}_same"] = align_equivalent(fn(idss[0], E, bm), ma.moe_align_torch(idss[0], E, bm),
                                                             idss[0], bm)
                    r[f"{impl}_us"] = safe_us([lambda i=i: fn(idss[i], E, bm) for i in range(len(idss))])
                except Exception as ex:
                    traceback.print_exc()
                    r[f"{impl}_error"] = repr(ex)[:200]
            rows.append(r)
            log("ROW", json.dumps(r))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=",".join(s for s in SHAPES if s != "tiny" and not s.endswith("-down")))
    p.add_argument("--ms", default="1,64,1024")
    p.add_argument("--deadline-s", type=float, default=1e9)
    p.add_argument("--kernels", default="lowbit,planar,tc", help="comma list of lowbit,planar,tc,tcg")
    p.add_argument("--tcg", default=TCG, help="tcg (Gluon) configs: BM:BN:warps:stages:GROUP_M:SWAP[:REFILL[:MAXNREG]],...")
    p.add_argument("--max-planar", type=int, default=100, help="first N planar configs of the list only")
    p.add_argument("--max-tc", type=int, default=100, help="first N tc configs of the list only")
    p.add_argument("--tc", default="", help="tc configs instead of the list: BM:BN:warps:stages:swap:dec,...")
    p.add_argument("--align", type=int, default=1, help="time the sort/align implementations first")
    p.add_argument("--humming", default="qwen3-30b-a3b", help="shapes on which Humming runs too")
    p.add_argument("--humming-by-s", type=float, default=60, help="build no Humming layer after this many seconds")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    rows = []
    meta = {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(sys.argv)}
    def save():
        with open(os.path.join(args.out, "moe_sweep.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    SAVE[0] = save
    if args.align:
        try:
            align_timings(rows)
        except Exception:
            traceback.print_exc()
    for name in args.shapes.split(","):
        if time.time() - t0 > args.deadline_s:
            log("deadline: skipping", name)
            continue
        try:
            sweep_shape(name, [int(v) for v in args.ms.split(",")], rows, args)
        except Exception:
            traceback.print_exc()
        torch.cuda.empty_cache()
        with open(os.path.join(args.out, "moe_sweep.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__" and not {"--markdown", "--to-cache", "--plot"} & set(sys.argv):
    main()


def to_markdown(d: dict) -> str:
    """tables of a moe_sweep.json: configs per (shape, M) fastest first, then the align timings."""
    rows, meta = d["rows"], d["meta"]
    out = [f"GPU {meta['gpu']}, {meta['date']}, `{meta['command']}`", ""]
    keys = list(dict.fromkeys((r["shape"], r["M"]) for r in rows if "shape" in r))
    for shape, M in keys:
        sr = sorted((r for r in rows if r.get("shape") == shape and r["M"] == M), key=lambda r: r.get("us") or 1e9)
        r0 = next((r for r in sr if "touched_experts" in r), sr[0])
        out += [f"### {shape} M={M} (E={r0['E']} top-{r0['top_k']}, N={r0['N']} K={r0['K']}, "
                f"{r0.get('touched_experts', 0):.1f} experts touched per call)", "",
                "| kernel | BM | BN | split | warps | stages | swap | KB / DEC | us | GB/s | err |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sr:
            c = r.get("cfg") or {}
            swap = c.get("SWAP", c.get("SWAP_AB", ""))
            us = f"{r['us']:.1f}" if r.get("us") else r.get("error", "-")[:40]
            err = f"{r['err']:.1e}" if r.get("err") is not None else "-"
            out.append(f"| {r.get('kernel', r.get('peer'))}{' (default)' if r.get('default') else ''} | {c.get('BM', '')} | "
                       f"{c.get('BN', '')} | {c.get('SPLIT_K', '')} | {c.get('num_warps', '')} | "
                       f"{c.get('num_stages', '')} | {swap} | {c.get('KB', c.get('DEC', ''))} | {us} | {r.get('GBps', '-')} | {err} |")
        out.append("")
    al = [r for r in rows if r.get("align")]
    if al:
        out += ["### sort/align (us)", "", "| E | top-k | M | BM | torch | single-CTA default | many-CTA fast | fast == torch blocks |",
                "|---|---|---|---|---|---|---|---|"]
        for r in al:
            f = lambda k: f"{r[k]:.1f}" if r.get(k) else "-"  # noqa: E731
            out.append(f"| {r['E']} | {r['top_k']} | {r['M']} | {r['BM']} | {f('torch_us')} | {f('default_us')} | "
                       f"{f('fast_us')} | {r.get('fast_same')} |")
    return "\n".join(out) + "\n"


def to_cache(files: list[str], cache: str) -> dict:
    """the fastest planar config per (shape, M) of sweep JSONs -> entries of a low-bit tune cache file (those whose
    block_m is the one FusedMoE uses at that M: moe_config's; the others cannot be looked up)."""
    from kestrel.kernels.configs import load_cache, m_bucket, shape_key
    from pathlib import Path
    best = {}
    for fn in files:
        d = json.load(open(fn))
        gpu = d["meta"]["gpu"]
        for r in d["rows"]:
            if r.get("kernel") != "planar" or not r.get("us") or (r.get("err") or 1) > 1e-2 or r["cfg"].get("TC"):
                continue  # (TC: a variant measured in round 1 and removed since)
            E, k, N, K, M = r["E"], r["top_k"], r["N"], r["K"], r["M"]
            if r["cfg"]["BM"] != moe_config(M * k, E, "bf16", planar=True).BM:
                continue
            key = shape_key(gpu, f"moe-int4p-e{E}k{k}", N, K, m_bucket(M))
            if key not in best or r["us"] < best[key]["us"]:
                cfg = {k_: v_ for k_, v_ in r["cfg"].items() if k_ != "TC"}
                best[key] = {"config": cfg, "kind": "mv", "us": round(r["us"], 3), "source": os.path.basename(fn)}
    data = dict(load_cache(Path(cache)))
    data.update(best)
    Path(cache).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return best


def plot(files: list[str], png: str) -> None:
    """bar chart: the fastest config of each kernel (and Humming) per (shape, M), as achieved GB/s."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for fn in files for r in json.load(open(fn))["rows"] if r.get("shape") and r.get("GBps")]
    cases = list(dict.fromkeys((r["shape"], r["M"]) for r in rows))
    kinds = ("lowbit", "planar", "humming_int4")
    fig, ax = plt.subplots(figsize=(max(6, len(cases) * 0.9), 4.5))
    for j, kind in enumerate(kinds):
        vals = [max((r["GBps"] for r in rows if (r["shape"], r["M"]) == c and (r.get("kernel") or r.get("peer")) == kind),
                    default=0) for c in cases]
        ax.bar([i + (j - 1) * 0.27 for i in range(len(cases))], vals, 0.27, label=kind)
    ax.set_xticks(range(len(cases)), [f"{s.split('-')[0]} M={m}" for s, m in cases], rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("GB/s of touched expert weights (best config)")
    ax.set_title("grouped MoE up projection, int4 g128 W4A16, H200")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__" and len(sys.argv) >= 4 and sys.argv[1] == "--plot":  # --plot PNG JSON...
    plot(sys.argv[3:], sys.argv[2])
if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--markdown":
    print(to_markdown(json.load(open(sys.argv[2]))))
if __name__ == "__main__" and len(sys.argv) >= 4 and sys.argv[1] == "--to-cache":  # --to-cache CACHE JSON...
    for k_, v_ in to_cache(sys.argv[3:], sys.argv[2]).items():
        print(k_, v_["us"], v_["config"])
