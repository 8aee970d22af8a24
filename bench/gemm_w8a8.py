"""Low-bit dense GEMMs on one GPU, peers side by side in one process:
  FP8 W8A8   kestrel vs torch._scaled_mm (cuBLASLt, row-wise scales) vs Humming W8A8 (fp8 weights, dynamic fp8 act)
  INT8 W8A8  kestrel vs torch._int_mm (+ scale epilogue in torch) vs Humming W8A8 int8 (dynamic int8 act)
  W4A8       kestrel int4 g128 x fp8 vs Humming W4A8 (int4 g128, fp8 act) vs kestrel WNA16 int4 vs cuBLAS bf16
  W4A4       kestrel MXFP4 x MXFP4 (bf16-MMA emulation) vs cuBLAS bf16 (Humming's fp4 activations need sm_100)

Timing: calls captured 20x in a CUDA graph rotating over weight copies (>= 256 MB in all, so L2 holds none),
median of 20 replays. "gemm" = quantized operands given; "e2e" = bf16 activations in (activation quant included).
Every kestrel result is checked on the GPU against dequantize-then-matmul (rel. Frobenius error printed).
Writes raw JSON + markdown table + PNG to --out (default $OUT or bench_out).

  python bench/gemm_w8a8.py                         # all sections
  python bench/gemm_w8a8.py --sections fp8 --ms 1,16,4096 --shapes 8192x8192
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpu_timing import graph_us  # noqa: E402
from kestrel.kernels import act_quant as aq  # noqa: E402
from kestrel.kernels.gemm_w4a4 import w4a4_linear  # noqa: E402
from kestrel.kernels.gemm_w4a8 import gemm_w4a8, quantize_weight_w4, w4a8_linear  # noqa: E402
import kestrel.kernels.gemm_w4a8 as g4  # noqa: E402
import kestrel.kernels.gemm_w4a8_tcg as tcg  # noqa: E402
from kestrel.kernels.gemm_w8a8 import gemm_w8a8, gemm_w8a16, quantize_weight_w8a8, ref_gemm_w8a8, w8a8_linear  # noqa: E402
from kestrel.kernels.lowbit_gemm import A_BF16, W_FP8, GemmConfig, heuristic_config  # noqa: E402
from kestrel.kernels.timing import cold_copies  # noqa: E402

T0 = time.time()
DEADLINE = [float("inf")]  # seconds after T0 after which no new case starts (set by --deadline-s)


def past_deadline() -> bool:
    if time.time() - T0 > DEADLINE[0]:
        log("deadline reached: skipping the remaining cases")
        return True
    return False


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


class LogRow(dict):
    """a result row that logs each timing / error as it is measured, so a job killed by its timeout still shows
    the measurements made before."""
    def __setitem__(self, k, v):
        super().__setitem__(k, v)
        if k.endswith(("_us", "err_vs_dequant", "err_vs_bf16", "_error", "err_vs_plain")):
            log(f"  {self.get('section')} M={self.get('M')} {k} = {v if not isinstance(v, float) else f'{v:.4g}'}")


# the Gluon W4A8 kernel's tiles timed beside its pick (gemm_w4a8_tcg.pick_tile), (block_m, mh, split_k, stages, kh,
# pp, pk): 256-token tiles in two halves (one decode per 256 tokens) or 128, unsplit / split 2 / 4; kh the K-halves
# consumer, pp the consumers' wgmma issues in turn, pk the permuted-K integer decode (activations from
# quant_fp8(perm=True)) (pp, pk: session 22). TCG_FOLD: the MXFP4 fold kernel's (block_m, kh, pp)
TCG_TILES = [(256, 128, 1, 4, 0, 0, 0), (256, 128, 2, 4, 0, 0, 0), (256, 128, 4, 4, 0, 0, 0), (256, 128, 1, 4, 1, 0, 0),
             (256, 128, 1, 4, 0, 1, 0), (256, 128, 2, 4, 0, 1, 0), (256, 128, 1, 4, 0, 0, 1), (256, 128, 1, 4, 0, 1, 1),
             (256, 128, 2, 4, 0, 1, 1), (256, 128, 1, 4, 1, 1, 0), (128, 0, 1, 4, 0, 0, 0), (128, 0, 1, 4, 0, 1, 0),
             (128, 0, 1, 4, 0, 1, 1), (128, 0, 2, 4, 0, 1, 1)]
TCG_FOLD = [(256, False, False), (256, True, False), (256, False, True), (256, True, True)]
if os.environ.get("BENCH_TCG_TILES", "1") == "0":  # the defaults alone (a short round)
    TCG_TILES.clear()
    TCG_FOLD.clear()
LEAN = [False]  # --lean: the headline columns only (no tile variants, no plain-pair / fast-accum / a16 extras)
WARM_ONLY = [False]  # --warm-only: run every call once (fills the Triton / Humming JIT caches), time nothing
W8A8_CFGS: list = []  # --fp8-cfgs: FP8 TMA configs (incl. in-kernel split-K) timed beside the default
W4A8_CFGS: list = []  # --w4a8-cfgs: swapped W4A8 tile configs timed beside the default (M = 64 grid-fill options)


def safe_us(fns) -> float | None:
    try:
        if WARM_ONLY[0]:
            fns[0]()
            torch.cuda.synchronize()
            return None
        return graph_us(fns)
    except Exception as ex:  # a peer that cannot run a case is reported as missing, not fatal
        log("  timing failed:", repr(ex)[:300])
        torch.cuda.synchronize()
        return None


def rel(y, ref) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


# Humming's MXFP4 weight config (the same dict bench/gemm_wna16.py's W4A16 peer uses)
HUMMING_MXFP4 = {"dtype": "float4e2m1", "group_size": 32, "scale_dtype": "float8e8m0"}


def copies_for(nbytes: int) -> int:
    return cold_copies(nbytes, most=4)


def humming_layer(N, K, wcfg, icfg, W):
    from humming.layer import HummingLayer
    layer = HummingLayer(shape_n=N, shape_k=K, weight_config=dict(wcfg), input_config=dict(icfg) if icfg else None,
                         torch_dtype=torch.bfloat16).cuda()
    layer.load_from_unquantized(W)
    layer.transform()
    return layer


def humming_build(what: str, build, budget: float):
    """build() (Humming JITs for seconds per layer) unless `budget` seconds have passed; None if skipped or failed."""
    if time.time() - T0 >= budget:
        return None
    try:
        t = time.time()
        out = build()
        log(f"  humming {what} ready ({time.time() - t:.1f}s)")
        return out
    except Exception:
        traceback.print_exc()
        return None


def add_run_args(p: argparse.ArgumentParser, budget_s: float) -> None:
    """the options gemm_w8a8.py and moe.py share (Humming budget, deadline, output folder, warm-only)."""
    p.add_argument("--budget-s", type=float, default=budget_s, help="skip Humming (slow JIT) once this much time has passed")
    p.add_argument("--deadline-s", type=float, default=float("inf"), help="start no new case after this many seconds")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="output folder")
    p.add_argument("--warm-only", action="store_true", help="run each call once to fill the JIT caches; no timing")
    p.add_argument("--lean", action="store_true", help="headline columns only: kestrel gemm / e2e (default path), "
                   "_scaled_mm / _int_mm, Humming (saves the JIT of the tile variants)")


def start_run(args, script: str) -> dict:
    """apply add_run_args' options, seed torch; -> the run's metadata (GPU, date, versions, command)."""
    if not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA GPU")
    DEADLINE[0] = args.deadline_s
    WARM_ONLY[0] = args.warm_only
    LEAN[0] = getattr(args, "lean", False)
    import triton
    meta = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "torch": torch.__version__, "triton": triton.__version__, "command": " ".join(sys.argv)}
    try:
        import humming
        meta["humming"] = humming.__version__
    except Exception as ex:
        meta["humming"] = f"unavailable: {ex!r}"
    torch.manual_seed(0)
    return meta


def scaled_mm(a, s, wq, ws_row, fast=False):
    return torch._scaled_mm(a, wq.t(), scale_a=s, scale_b=ws_row, out_dtype=torch.bfloat16, use_fast_accum=fast)


def pdl_case(r, x, q, nc):
    """above the fused-decode M: act quant + GEMM as a programmatic dependent launch pair (the GEMM prefetches its
    first weight lines into the L2 while the quant runs; w8a8_linear's default up to gemm_w8a8.PDL_MAX_M tokens),
    checked against the plain pair, both timed (lean too: they decide PDL_MAX_M)."""
    from kestrel.kernels.gemm_w8a8 import FUSED_MAX_M
    if x.shape[0] <= FUSED_MAX_M:
        return
    try:
        r["pdl_err_vs_plain"] = rel(w8a8_linear(x, *q[0], pdl=True), w8a8_linear(x, *q[0], pdl=False))
        r["kestrel_e2e_pdl_us"] = safe_us([lambda i=i: w8a8_linear(x, *q[i], pdl=True) for i in range(nc)])
        r["kestrel_e2e_nopdl_us"] = safe_us([lambda i=i: w8a8_linear(x, *q[i], pdl=False) for i in range(nc)])
    except Exception as ex:
        traceback.print_exc()
        r["pdl_error"] = repr(ex)[:200]


def run_fp8(N, K, ms, rows, budget):
    nc = copies_for(N * K)
    Ws = [torch.randn(N, K, device="cuda") * 0.02 for _ in range(nc)]
    q = [quantize_weight_w8a8(W, "fp8") for W in Ws]
    ws_row = [s.view(1, N).contiguous() for _, s in q]
    hum = humming_build("fp8 layers", lambda: [humming_layer(N, K, {"dtype": "float8e4m3"}, {"dtype": "float8e4m3"},
                                                             W.to(torch.bfloat16)) for W in Ws], budget)
    for M in ms:
        if past_deadline():
            break
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        a, s = aq.quant_fp8(x)
        r = LogRow(section="fp8", M=M, N=N, K=K)
        y = gemm_w8a8(a, s, *q[0])
        r["err_vs_dequant"] = rel(y, ref_gemm_w8a8(a, s, *q[0]))
        r["kestrel_gemm_us"] = safe_us([lambda i=i: gemm_w8a8(a, s, *q[i]) for i in range(nc)])
        r["kestrel_e2e_us"] = safe_us([lambda i=i: w8a8_linear(x, *q[i]) for i in range(nc)])
        pdl_case(r, x, q, nc)
        for cfg in W8A8_CFGS:  # each: err vs dequant, GEMM alone and e2e (quant + GEMM, no PDL)
            tag = f"kestrel_fp8_bm{cfg.BM}bn{cfg.BN}s{cfg.SPLIT_K}w{cfg.num_warps}st{cfg.num_stages}t{cfg.TMA}"
            r[f"{tag}_err"] = rel(gemm_w8a8(a, s, *q[0], config=cfg), ref_gemm_w8a8(a, s, *q[0]))
            r[f"{tag}_gemm_us"] = safe_us([lambda i=i, c=cfg: gemm_w8a8(a, s, *q[i], config=c) for i in range(nc)])
            r[f"{tag}_e2e_us"] = safe_us([lambda i=i, c=cfg: gemm_w8a8(*aq.quant_fp8(x), *q[i], config=c)
                                          for i in range(nc)])
        if 16 < M <= 256 and not LEAN[0]:  # deeper TMA pipelines than the swept ones (the swept best was 0.91-0.99x cuBLASLt here)
            # (run 5: 6 stages = the default, BK 256 slower.) BN 64 / 32: 2-4x the CTAs of the 64x128 tiles
            # (8192 wide at M = 64: 64 CTAs for 132 SMs), and the swapped pointer kernel with a K split
            for tag, cfg in (("bn64", GemmConfig(BM=64, BN=64, BK=128, num_warps=4, num_stages=6, TMA=1)),
                             ("bn32", GemmConfig(BM=64, BN=32, BK=128, num_warps=4, num_stages=8, TMA=1)),
                             ("sw64k2", GemmConfig(BM=64, BN=64, BK=128, SPLIT_K=2, num_warps=4, num_stages=4,
                                                   SWAP_AB=1))):
                r[f"kestrel_gemm_{tag}_us"] = safe_us([lambda i=i, cfg=cfg: gemm_w8a8(a, s, *q[i], config=cfg)
                                                       for i in range(nc)])
        if M <= 16 and not LEAN[0]:  # decode alternative: bf16 activations straight into the fp8-weight kernel (no act-quant launch)
            h = heuristic_config(M, N, K, A_BF16, W_FP8)
            for tag, cfg in (("a16", h), ("a16_bk128", dataclasses.replace(h, BK=128))):
                try:
                    ya = gemm_w8a16(x, *q[0], config=cfg)
                    r[f"kestrel_{tag}_err_vs_bf16_dequant"] = rel(ya, x.float() @ (q[0][0].float() * q[0][1][:, None]).t())
                    r[f"kestrel_{tag}_e2e_us"] = safe_us([lambda i=i, cfg=cfg: gemm_w8a16(x, *q[i], config=cfg)
                                                          for i in range(nc)])
                except Exception as ex:
                    r[f"kestrel_{tag}_error"] = repr(ex)[:200]
        try:
            yc = scaled_mm(a, s, q[0][0], ws_row[0])
            r["scaled_mm_err_vs_dequant"] = rel(yc, ref_gemm_w8a8(a, s, *q[0]))
            r["scaled_mm_us"] = safe_us([lambda i=i: scaled_mm(a, s, q[i][0], ws_row[i]) for i in range(nc)])
            # same numerics as kestrel's TMA path (M > 16): fp8 products summed in the wgmma accumulator over all K
            if not LEAN[0]:
                r["scaled_mm_fast_us"] = safe_us([lambda i=i: scaled_mm(a, s, q[i][0], ws_row[i], True) for i in range(nc)])
            r["scaled_mm_e2e_us"] = safe_us([lambda i=i: scaled_mm(*aq.quant_fp8(x), q[i][0], ws_row[i])
                                             for i in range(nc)])
        except Exception as ex:
            r["scaled_mm_error"] = repr(ex)[:200]
        if hum is not None:
            try:
                yh = hum[0](x)
                r["humming_err_vs_bf16"] = rel(yh, x.float() @ Ws[0].t())
                r["humming_e2e_us"] = safe_us([lambda L=L: L(x) for L in hum])
            except Exception as ex:
                r["humming_error"] = repr(ex)[:200]
        r["cublas_bf16_us"] = safe_us([lambda W=W.to(torch.bfloat16): x @ W.t() for W in Ws[:1]] * 1)
        r["kestrel_tflops"] = 2 * M * N * K / (r["kestrel_gemm_us"] or float("inf")) / 1e6
        rows.append(r)
        log("ROW", json.dumps(r))
    del hum, Ws
    torch.cuda.empty_cache()


def run_int8(N, K, ms, rows, budget):
    nc = copies_for(N * K)
    Ws = [torch.randn(N, K, device="cuda") * 0.02 for _ in range(nc)]
    q = [quantize_weight_w8a8(W, "int8") for W in Ws]
    wt = [wq.t() for wq, _ in q]
    hum = humming_build("int8 layers", lambda: [humming_layer(N, K, {"dtype": "int8"}, {"dtype": "int8"},
                                                              W.to(torch.bfloat16)) for W in Ws], budget)
    for M in ms:
        if past_deadline():
            break
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        a, s = aq.quant_int8(x)
        r = LogRow(section="int8", M=M, N=N, K=K)
        r["err_vs_dequant"] = rel(gemm_w8a8(a, s, *q[0]), ref_gemm_w8a8(a, s, *q[0]))
        r["kestrel_gemm_us"] = safe_us([lambda i=i: gemm_w8a8(a, s, *q[i]) for i in range(nc)])
        r["kestrel_e2e_us"] = safe_us([lambda i=i: w8a8_linear(x, *q[i]) for i in range(nc)])
        pdl_case(r, x, q, nc)
        if M > 16:  # torch._int_mm needs M > 16
            r["int_mm_scaled_us"] = safe_us([lambda i=i: (torch._int_mm(a, wt[i]).float() * s * q[i][1]).to(torch.bfloat16)
                                             for i in range(nc)])
            r["int_mm_e2e_us"] = safe_us([lambda i=i: (lambda a, s: (torch._int_mm(a, wt[i]).float() * s * q[i][1])
                                                       .to(torch.bfloat16))(*aq.quant_int8(x)) for i in range(nc)])
        if hum is not None:  # Humming W8A8 int8 (int8 weights per channel, dynamic per-token int8 activations)
            try:
                r["humming_err_vs_bf16"] = rel(hum[0](x), x.float() @ Ws[0].t())
                r["humming_e2e_us"] = safe_us([lambda L=L: L(x) for L in hum])
            except Exception as ex:
                r["humming_error"] = repr(ex)[:200]
        rows.append(r)
        log("ROW", json.dumps(r))
    del hum, Ws
    torch.cuda.empty_cache()


def run_w4(N, K, ms, rows, budget, sections):
    nc = copies_for(N * K // 2)
    Ws = [torch.randn(N, K, device="cuda") * 0.02 for _ in range(nc)]
    # W4A8 weights in the kernel layout (W4Weight.kernel_layout, "halves" packing; Humming repacks in transform()
    # too); the interchange "pairs" packing is timed beside it (kestrel_w4a8_pairs_gemm_us)
    w4p = [quantize_weight_w4(W, "int4", 128) for W in Ws] if "w4a8" in sections else []
    w4 = [q.kernel_layout() for q in w4p]
    mx = [quantize_weight_w4(W, "mxfp4") for W in Ws] if {"w4a4", "w4a8mx"} & set(sections) else []
    wna, gemm_wna16 = [], None
    if w4:
        try:  # kestrel's WNA16 (the part-1 kernel), same int4 g128 weights
            from kestrel.kernels.gemm_wna16 import gemm_wna16
            from kestrel.kernels.tuning import FORMATS
            from kestrel.quant import quantize
            wna = [quantize(W, FORMATS["int4"]) for W in Ws]
        except Exception:
            traceback.print_exc()
    Wb = [W.to(torch.bfloat16) for W in Ws]
    hum = humming_build("w4a8 layers", lambda: [
        humming_layer(N, K, {"dtype": "int4", "group_size": 128}, {"dtype": "float8e4m3"}, W) for W in Wb],
        budget) if w4 else None
    # Humming's own MXFP4 x fp8 e4m3 layer (e2m1 weights, e8m0 scales per 32, per-token fp8 input): the like-for-like
    # peer of the MXFP4 rows (until session 25 they were set against its int4 g128 layer only)
    hum_mx = humming_build("w4a8 mxfp4 layers", lambda: [
        humming_layer(N, K, HUMMING_MXFP4, {"dtype": "float8e4m3"}, W) for W in Wb],
        budget) if mx and "w4a8mx" in sections else None
    for M in ms:
        if past_deadline():
            break
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        r = LogRow(section="w4", M=M, N=N, K=K)
        r["cublas_bf16_us"] = safe_us([lambda W=W: x @ W.t() for W in Wb])
        if w4:
            a, s = aq.quant_fp8(x)
            r["w4a8_err_vs_dequant"] = rel(gemm_w4a8(a, s, w4[0]), aq.dequant_8bit(a, s) @ w4[0].dequantize().t())
            r["kestrel_w4a8_gemm_us"] = safe_us([lambda i=i: gemm_w4a8(a, s, w4[i]) for i in range(nc)])
            if not LEAN[0]:  # (lean: the default layout / path only)
                r["kestrel_w4a8_pairs_gemm_us"] = safe_us([lambda i=i: gemm_w4a8(a, s, w4p[i]) for i in range(nc)])
            r["kestrel_w4a8_e2e_us"] = safe_us([lambda i=i: w4a8_linear(x, w4[i]) for i in range(nc)])
            # the default path with one option flipped, same process: TCG_PK (the permuted quant, int4 route),
            # gemm_w4a8_tcg.REDUCE (the Gluon kernels' in-kernel split-K sum) and act_quant.NATIVE_CVT (the quant's
            # hardware e4m3 conversion)
            route = g4._tcg_route(x, w4[0], None)
            flips = ([(g4, "TCG_PK", "pk")] if route == "int4" else []) + ([(tcg, "REDUCE", "reduce")] if route else [])
            for mod, attr, name in flips + [(aq, "NATIVE_CVT", "native")]:
                saved = getattr(mod, attr)
                setattr(mod, attr, not saved)
                try:
                    tag = f"kestrel_w4a8_{'no' if saved else ''}{name}"
                    r[f"{tag}_err"] = rel(w4a8_linear(x, w4[0]), aq.dequant_8bit(a, s) @ w4[0].dequantize().t())
                    r[f"{tag}_e2e_us"] = safe_us([lambda i=i: w4a8_linear(x, w4[i]) for i in range(nc)])
                finally:
                    setattr(mod, attr, saved)
            # the two W4A8 paths forced, side by side (default: WNA16 kernels up to gemm_w4a8.BF16_MAX_M tokens)
            r["w4a8_bf16_err_vs_dequant"] = rel(w4a8_linear(x, w4[0], bf16_max_m=1 << 30),
                                                aq.dequant_8bit(a, s) @ w4[0].dequantize().t())
            r["kestrel_w4a8_viawna16_e2e_us"] = safe_us([lambda i=i: w4a8_linear(x, w4[i], bf16_max_m=1 << 30)
                                                         for i in range(nc)])
            r["kestrel_w4a8_fp8_e2e_us"] = safe_us([lambda i=i: w4a8_linear(x, w4[i], bf16_max_m=0, tcg=False)
                                                    for i in range(nc)])
            if M > 16:  # the Gluon fp8 kernel (gemm_w4a8_tcg.py) forced, on the same planar twin
                r["w4a8_tcg_err_vs_dequant"] = rel(gemm_w4a8(a, s, w4[0], bf16_max_m=0, tcg=True),
                                                   aq.dequant_8bit(a, s) @ w4[0].dequantize().t())
                r["kestrel_w4a8_tcg_gemm_us"] = safe_us([lambda i=i: gemm_w4a8(a, s, w4[i], bf16_max_m=0, tcg=True)
                                                         for i in range(nc)])
                r["kestrel_w4a8_tcg_e2e_us"] = safe_us([lambda i=i: w4a8_linear(x, w4[i], bf16_max_m=0, tcg=True)
                                                        for i in range(nc)])
                from kestrel.kernels.gemm_w4a8_tcg import gemm_w4a8_tcg
                tw = [w.wna16() for w in w4]
                ap = aq.quant_fp8(x, perm=True)[0]
                ref = aq.dequant_8bit(a, s) @ w4[0].dequantize().t()
                for bm, mh, sp, st, kh, pp, pk in TCG_TILES:  # the Gluon kernel's tiles forced (GEMM alone)
                    tag = (f"kestrel_w4a8_tcg_bm{bm}{'h' if mh else ''}s{sp}st{st}{'kh' if kh else ''}"
                           f"{'pp' if pp else ''}{'pk' if pk else ''}")
                    kw = dict(block_m=bm, mh=mh, split_k=sp, stages=st, kh=kh, pp=pp, a_perm=bool(pk))
                    aa = ap if pk else a
                    r[f"{tag}_err"] = rel(gemm_w4a8_tcg(aa, s, tw[0], **kw), ref)
                    r[f"{tag}_gemm_us"] = safe_us([lambda i=i, kw=kw, aa=aa: gemm_w4a8_tcg(aa, s, tw[i], **kw)
                                                   for i in range(nc)])
                # the candidate default: pick_tile's tile, pp + pk, the permuted quant included
                r["kestrel_w4a8_tcg_pppk_e2e_us"] = safe_us([lambda i=i: gemm_w4a8_tcg(
                    *aq.quant_fp8(x, perm=True), tw[i], pp=True, a_perm=True) for i in range(nc)])
            if M > 256 and not LEAN[0]:  # the expand-to-fp8 + TMA path's alternative: the fused in-register (swapped) kernel
                fused = GemmConfig(BM=128, BN=128, BK=128, num_warps=8, num_stages=3, SWAP_AB=1)
                r["kestrel_w4a8_fused_gemm_us"] = safe_us([lambda i=i: gemm_w4a8(a, s, w4[i], config=fused)
                                                           for i in range(nc)])
            for cfg in W4A8_CFGS:  # each: err vs dequant, GEMM alone and with the per-token act quant
                tag = f"kestrel_w4a8_bm{cfg.BM}bn{cfg.BN}s{cfg.SPLIT_K}w{cfg.num_warps}st{cfg.num_stages}"
                r[f"{tag}_err"] = rel(gemm_w4a8(a, s, w4[0], config=cfg),
                                      aq.dequant_8bit(a, s) @ w4[0].dequantize().t())
                r[f"{tag}_gemm_us"] = safe_us([lambda i=i, c=cfg: gemm_w4a8(a, s, w4[i], config=c) for i in range(nc)])
                r[f"{tag}_e2e_us"] = safe_us([lambda i=i, c=cfg: gemm_w4a8(*aq.quant_fp8(x), w4[i], config=c)
                                              for i in range(nc)])
            if wna:
                r["kestrel_wna16_int4_us"] = safe_us([lambda i=i: gemm_wna16(x, wna[i]) for i in range(nc)])
            if hum is not None:
                try:
                    r["humming_w4a8_err_vs_bf16"] = rel(hum[0](x), x.float() @ Ws[0].t())
                    r["humming_w4a8_e2e_us"] = safe_us([lambda L=L: L(x) for L in hum])
                except Exception as ex:
                    r["humming_error"] = repr(ex)[:200]
        if mx and "w4a8mx" in sections:  # MXFP4 weights x fp8: the default path vs each path forced
            a, s = aq.quant_fp8(x)
            ref = aq.dequant_8bit(a, s) @ mx[0].dequantize().t()
            r["w4a8_mxfp4_err_vs_dequant"] = rel(gemm_w4a8(a, s, mx[0]), ref)
            r["kestrel_w4a8_mxfp4_gemm_us"] = safe_us([lambda i=i: gemm_w4a8(a, s, mx[i]) for i in range(nc)])
            r["kestrel_w4a8_mxfp4_e2e_us"] = safe_us([lambda i=i: w4a8_linear(x, mx[i]) for i in range(nc)])
            if hum_mx is not None:
                try:
                    r["humming_w4a8_mxfp4_err_vs_bf16"] = rel(hum_mx[0](x), x.float() @ Ws[0].t())
                    r["humming_w4a8_mxfp4_e2e_us"] = safe_us([lambda L=L: L(x) for L in hum_mx])
                except Exception as ex:
                    r["humming_mxfp4_error"] = repr(ex)[:200]
            saved = g4.FOLD_MIN_M, g4.FOLD_KERNEL
            try:  # fold: copy + the FP8 kernel; foldk: the Triton W4A8 kernel folding in registers; rescale: neither
                for tag, min_m, kern in (("fold", 1, False), ("foldk", 0, True), ("rescale", 0, False)):
                    if LEAN[0] and tag != "fold":  # (measured slower at every point in sessions 19 / 20)
                        continue
                    g4.FOLD_MIN_M, g4.FOLD_KERNEL = min_m, kern
                    if tag != "rescale" and mx[0].fold_base() is None:
                        continue
                    r[f"w4a8_mxfp4_{tag}_err_vs_dequant"] = rel(gemm_w4a8(a, s, mx[0], bf16_max_m=0), ref)
                    r[f"kestrel_w4a8_mxfp4_{tag}_gemm_us"] = safe_us([lambda i=i: gemm_w4a8(a, s, mx[i], bf16_max_m=0)
                                                                      for i in range(nc)])
                    r[f"kestrel_w4a8_mxfp4_{tag}_e2e_us"] = safe_us([lambda i=i: w4a8_linear(x, mx[i], bf16_max_m=0)
                                                                     for i in range(nc)])
            finally:
                g4.FOLD_MIN_M, g4.FOLD_KERNEL = saved
            if mx[0].fold_mult() is not None and M > 16:  # the Gluon fold kernel (gemm_w4a8_tcg.py) forced
                from kestrel.kernels.gemm_w4a8_tcg import gemm_w4a8_fold_tcg
                tw = [w.wna16() for w in mx]
                fm = [w.fold_mult() for w in mx]
                for bm, kh, pp in TCG_FOLD:
                    tag = f"kestrel_w4a8_mxfp4_tcg_bm{bm}{'kh' if kh else ''}{'pp' if pp else ''}"
                    kw = dict(block_m=bm, kh=kh, pp=pp)
                    r[f"{tag}_err"] = rel(gemm_w4a8_fold_tcg(a, s, tw[0], *fm[0], **kw), ref)
                    r[f"{tag}_gemm_us"] = safe_us([lambda i=i, kw=kw: gemm_w4a8_fold_tcg(a, s, tw[i], *fm[i], **kw)
                                                   for i in range(nc)])
                    r[f"{tag}_e2e_us"] = safe_us([lambda i=i, kw=kw: gemm_w4a8_fold_tcg(
                        *aq.quant_fp8(x), tw[i], *fm[i], **kw) for i in range(nc)])
        if mx and "w4a4" in sections:
            ya = w4a4_linear(x, mx[0])
            qa, sa = aq.quant_mxfp4(x)
            r["w4a4_err_vs_dequant"] = rel(ya, aq.dequant_mxfp4(qa, sa) @ mx[0].dequantize().t())
            r["kestrel_w4a4_mxfp4_e2e_us"] = safe_us([lambda i=i: w4a4_linear(x, mx[i]) for i in range(nc)])
        rows.append(r)
        log("ROW", json.dumps(r))
    del hum, hum_mx
    torch.cuda.empty_cache()


def check_act_quant() -> dict:
    """GPU activation-quant kernels vs the CPU torch references: count of differing codes / scales."""
    out = {}
    x = (torch.randn(64, 4096) * torch.rand(64, 1) * 10).to(torch.bfloat16)
    xc = x.cuda()
    try:
        for name, fn, ref in (("fp8", aq.quant_fp8, aq.ref_quant_fp8), ("int8", aq.quant_int8, aq.ref_quant_int8),
                              ("mxfp4", aq.quant_mxfp4, aq.ref_quant_mxfp4), ("nvfp4", aq.quant_nvfp4, aq.ref_quant_nvfp4)):
            g, r = fn(xc), ref(x)
            out[name] = [int((a.cpu().view(torch.uint8) != b.view(torch.uint8)).sum()) if a.element_size() == 1
                         else float((a.cpu() - b).abs().max()) for a, b in zip(g, r)]
        q, s = aq.silu_mul_fp8(xc[:, :2048].float().contiguous().view(64, 2048))
        rq, rs = aq.ref_quant_fp8(aq.ref_silu_mul(x[:, :2048].float()))
        out["silu_mul_fp8_code_mismatch_frac"] = float((q.cpu().view(torch.uint8) != rq.view(torch.uint8)).float().mean())
    except Exception as ex:
        traceback.print_exc()
        out["error"] = repr(ex)[:300]
    return out


def mma_report() -> dict:
    """which MMA instructions the compiled kestrel GEMM variants use (wgmma = Hopper's async warpgroup MMA; the fp8
    wgmma needs both operands K-major). Read from the PTX of every variant this process compiled."""
    from kestrel.kernels import lowbit_gemm, lowbit_tma
    out = {}
    for name, fn in (("qgemm", lowbit_gemm._qgemm_kernel), ("tma", lowbit_tma._w8a8_tma_kernel)):
        try:
            counts = {"variants": 0, "wgmma": 0, "mma.sync": 0, "cp.async.bulk.tensor": 0}
            for caches in fn.device_caches.values():
                for ck in caches[0].values():
                    ptx = ck.asm.get("ptx", "") if hasattr(ck, "asm") else ""
                    counts["variants"] += 1
                    for ins in ("wgmma", "mma.sync", "cp.async.bulk.tensor"):
                        counts[ins] += ins in ptx
            out[name] = counts
        except Exception as ex:
            out[name] = repr(ex)[:200]
    return out


RATIOS = [  # (name, peer column, our column): > 1 means kestrel is faster
    ("fp8 gemm vs cuBLASLt _scaled_mm", "scaled_mm_us", "kestrel_gemm_us"),
    ("fp8 gemm vs cuBLASLt _scaled_mm fast-accum", "scaled_mm_fast_us", "kestrel_gemm_us"),
    ("fp8 e2e vs _scaled_mm + our act quant", "scaled_mm_e2e_us", "kestrel_e2e_us"),
    ("fp8 e2e vs Humming W8A8", "humming_e2e_us", "kestrel_e2e_us"),
    ("fp8 e2e, quant + GEMM as a PDL pair, vs Humming W8A8", "humming_e2e_us", "kestrel_e2e_pdl_us"),
    ("fp8 e2e: plain pair / PDL pair", "kestrel_e2e_nopdl_us", "kestrel_e2e_pdl_us"),
    ("fp8-weight decode, bf16 act (no act quant) vs Humming W8A8", "humming_e2e_us", "kestrel_a16_e2e_us"),
    ("fp8-weight decode, bf16 act, BK=128 vs Humming W8A8", "humming_e2e_us", "kestrel_a16_bk128_e2e_us"),
    ("fp8 gemm vs cuBLAS bf16", "cublas_bf16_us", "kestrel_gemm_us"),
    ("int8 gemm vs torch._int_mm+scale", "int_mm_scaled_us", "kestrel_gemm_us"),
    ("int8 e2e vs torch._int_mm+scale + our act quant", "int_mm_e2e_us", "kestrel_e2e_us"),
    ("w4a8 e2e vs Humming W4A8", "humming_w4a8_e2e_us", "kestrel_w4a8_e2e_us"),
    ("w4a8 e2e vs kestrel WNA16 int4", "kestrel_wna16_int4_us", "kestrel_w4a8_e2e_us"),
    ("w4a8 e2e, fp8 kernels forced, vs Humming W4A8", "humming_w4a8_e2e_us", "kestrel_w4a8_fp8_e2e_us"),
    ("w4a8 e2e, WNA16 kernels forced, vs Humming W4A8", "humming_w4a8_e2e_us", "kestrel_w4a8_viawna16_e2e_us"),
    ("w4a8 e2e: fp8 kernels / WNA16 kernels", "kestrel_w4a8_fp8_e2e_us", "kestrel_w4a8_viawna16_e2e_us"),
    ("w4a8 e2e, Gluon kernel forced, vs Humming W4A8", "humming_w4a8_e2e_us", "kestrel_w4a8_tcg_e2e_us"),
    ("w4a8 gemm: default path / Gluon kernel", "kestrel_w4a8_gemm_us", "kestrel_w4a8_tcg_gemm_us"),
    ("w4a8 gemm: fused in-register / default (expand + TMA)", "kestrel_w4a8_fused_gemm_us", "kestrel_w4a8_gemm_us"),
    ("w4a8 gemm: pairs packing / halves packing", "kestrel_w4a8_pairs_gemm_us", "kestrel_w4a8_gemm_us"),
    ("w4a8 e2e vs cuBLAS bf16", "cublas_bf16_us", "kestrel_w4a8_e2e_us"),
    ("w4a8 mxfp4 e2e (default path) vs Humming W4A8 MXFP4 (same format)", "humming_w4a8_mxfp4_e2e_us",
     "kestrel_w4a8_mxfp4_e2e_us"),
    ("w4a8 mxfp4 e2e (default path) vs Humming W4A8 (its int4 g128)", "humming_w4a8_e2e_us",
     "kestrel_w4a8_mxfp4_e2e_us"),
    ("Humming W4A8: its MXFP4 layer / its int4 g128 layer", "humming_w4a8_mxfp4_e2e_us", "humming_w4a8_e2e_us"),
    ("w4a8 mxfp4 e2e: per-group rescale kernels / default path", "kestrel_w4a8_mxfp4_rescale_e2e_us",
     "kestrel_w4a8_mxfp4_e2e_us"),
    ("w4a8 mxfp4 gemm: per-group rescale / scale fold", "kestrel_w4a8_mxfp4_rescale_gemm_us",
     "kestrel_w4a8_mxfp4_fold_gemm_us"),
    ("w4a8 mxfp4 gemm: per-group rescale / in-register fold", "kestrel_w4a8_mxfp4_rescale_gemm_us",
     "kestrel_w4a8_mxfp4_foldk_gemm_us"),
    ("w4a8 mxfp4 fold e2e vs Humming W4A8 (its int4 g128)", "humming_w4a8_e2e_us", "kestrel_w4a8_mxfp4_fold_e2e_us"),
    ("w4a8 mxfp4 Gluon fold 256 e2e vs Humming W4A8 (its int4 g128)", "humming_w4a8_e2e_us",
     "kestrel_w4a8_mxfp4_tcg_bm256_e2e_us"),
    ("w4a8 mxfp4 Gluon fold 256 K-halves e2e vs Humming W4A8 (its int4 g128)", "humming_w4a8_e2e_us",
     "kestrel_w4a8_mxfp4_tcg_bm256kh_e2e_us"),
    ("w4a8 mxfp4 fold e2e vs cuBLAS bf16", "cublas_bf16_us", "kestrel_w4a8_mxfp4_fold_e2e_us"),
    ("w4a4 mxfp4 e2e vs cuBLAS bf16", "cublas_bf16_us", "kestrel_w4a4_mxfp4_e2e_us"),
]


def write_report(rows, out, meta, stem="gemm_w8a8", ratios=None):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    cols = sorted({k for r in rows for k in r if k.endswith("_us")})
    lines = [f"# {stem} — {meta.get('gpu')} — {meta.get('date')}", "", f"command: `{meta.get('command')}`", "",
             "times in µs (CUDA graph of 20 calls, median of 20 replays); ratio > 1 = kestrel faster", ""]
    for sec in dict.fromkeys(r["section"] for r in rows):
        sr = [r for r in rows if r["section"] == sec]
        c = [k for k in cols if any(k in r for r in sr)]
        lines += [f"## {sec}", "", "| M | N | K | " + " | ".join(c) + " | err |",
                  "|" + "---|" * (len(c) + 4)]
        for r in sr:
            err = next((v for k, v in r.items() if k.endswith("err_vs_dequant")), None)
            lines.append(f"| {r['M']} | {r['N']} | {r['K']} | " + " | ".join(
                f"{r[k]:.1f}" if r.get(k) is not None else "-" for k in c) + f" | {err if err is None else f'{err:.1e}'} |")
        lines.append("")
    lines += ["## ratios (peer time / kestrel time)", "", "| comparison | M | N x K | ratio |", "|---|---|---|---|"]
    for name, peer, ours in ratios or RATIOS:
        for r in rows:
            if r.get(peer) and r.get(ours):
                lines.append(f"| {name}{'' if r['section'] in name else ' [' + r['section'] + ']'} | {r['M']} | "
                             f"{r['N']}x{r['K']} | {r[peer] / r[ours]:.2f} |")
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[-60:]))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        secs = list(dict.fromkeys(r["section"] for r in rows))
        fig, axes = plt.subplots(1, len(secs), figsize=(6 * len(secs), 4.5), squeeze=False)
        for ax, sec in zip(axes[0], secs):
            for shape in dict.fromkeys((r["N"], r["K"]) for r in rows if r["section"] == sec):
                sr = [r for r in rows if r["section"] == sec and (r["N"], r["K"]) == shape]
                for k in cols:
                    pts = [(r["M"], r[k]) for r in sr if r.get(k)]
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=f"{k.replace('_us', '')} {shape[0]}x{shape[1]}")
            ax.set_xscale("log", base=2); ax.set_yscale("log"); ax.set_xlabel("M"); ax.set_ylabel("µs")
            ax.set_title(sec); ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(os.path.join(out, f"{stem}.png"), dpi=110)
    except Exception:
        traceback.print_exc()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="fp8,int8,w4a8,w4a4", help="comma list of fp8,int8,w4a8,w4a8mx,w4a4 (w4a8mx: MXFP4 weights, default path vs the scale fold)")
    p.add_argument("--shapes", default="8192x8192,28672x8192", help="comma list of NxK weight shapes")
    p.add_argument("--ms", default="1,16,64,256,1024,4096", help="comma list of batch sizes M")
    p.add_argument("--w4a8-cfgs", default="", help="W4A8 swapped configs to time beside the default: "
                   "BM:BN:SPLIT:WARPS:STAGES,... (e.g. 64:64:2:4:4 for a K split at M = 64)")
    p.add_argument("--fp8-cfgs", default="", help="FP8 TMA configs to time beside the default: "
                   "BM:BN:SPLIT:WARPS:STAGES,... (e.g. 64:64:2:4:6: K split summed in the kernel)")
    add_run_args(p, budget_s=200)
    args = p.parse_args()
    W8A8_CFGS[:] = [GemmConfig(BM=bm, BN=bn, BK=128, SPLIT_K=sk, num_warps=w, num_stages=st, TMA=1)
                    for bm, bn, sk, w, st in (map(int, c.split(":")) for c in args.fp8_cfgs.split(",") if c)]
    W4A8_CFGS[:] = [GemmConfig(BM=bm, BN=bn, BK=128, SPLIT_K=sk, num_warps=w, num_stages=st, SWAP_AB=1)
                    for bm, bn, sk, w, st in (map(int, c.split(":")) for c in args.w4a8_cfgs.split(",") if c)]
    meta = start_run(args, "bench/gemm_w8a8.py")
    secs = args.sections.split(",")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    if not args.lean:
        meta["act_quant_gpu_vs_cpu_ref"] = check_act_quant()
    log(meta)
    rows = []
    for N, K in shapes:
        for sec, fn in (("fp8", lambda: run_fp8(N, K, ms, rows, args.budget_s)),
                        ("w4", lambda: run_w4(N, K, ms, rows, args.budget_s, secs)),
                        ("int8", lambda: run_int8(N, K, ms, rows, args.budget_s))):
            if sec in secs or (sec == "w4" and ({"w4a8", "w4a8mx", "w4a4"} & set(secs))):
                log(f"== {sec} {N}x{K}")
                try:
                    fn()
                except Exception:
                    traceback.print_exc()
                meta["mma_instructions"] = mma_report()
                write_report(rows, args.out, meta)


if __name__ == "__main__":
    main()
