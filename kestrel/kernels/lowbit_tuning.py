"""`kestrel tune --lowbit KERNEL`: measure candidate GemmConfigs of the W8A8 / W4A8 / W4A4 GEMMs on this GPU and
store the fastest per (GPU, kernel, N, K, M bucket) in the low-bit tune cache (lowbit_tune.py), which the kernels
read before falling back to lowbit_gemm.heuristic_config."""
from __future__ import annotations

import torch

from kestrel.kernels import act_quant as aq
from kestrel.kernels.configs import m_bucket
from kestrel.kernels.lowbit_gemm import (A_FP8, A_INT8, A_MXFP4, A_NVFP4, W_FP4, W_FP8, W_INT4, W_INT8, GemmConfig,
                                         candidate_configs, heuristic_config)
from kestrel.kernels.lowbit_tune import store
from kestrel.kernels.timing import cold_copies
from kestrel.kernels.tuning import fastest

# kernel name -> (activation format, weight format); the names are the cache keys the kernels look up
LOWBIT_KERNELS = {
    "w8a8-fp8": (A_FP8, "fp8"),
    "w8a8-int8": (A_INT8, "int8"),
    "w4a8-int4": (A_FP8, "int4"),
    "w4a8-mxfp4": (A_FP8, "mxfp4"),
    "w4a4-mxfp4": (A_MXFP4, "mxfp4"),
    "w4a4-nvfp4": (A_NVFP4, "nvfp4"),
    # the Gluon W4A8 kernels (gemm_w4a8_tcg.py, Hopper): token tile / split / stages, read by their launchers
    "w4a8tcg-int4": (A_FP8, "int4"),
    "w4a8tcg-mxfp4": (A_FP8, "mxfp4"),
}


def make_weights(kernel: str, N: int, K: int, device="cuda"):
    """-> (the kernel's weight operands, one tuple per L2-cold copy (one on the CPU), copy 0 dequantized fp32
    [N, K]): random N(0, 0.02) weights quantized as the kernel runs them. Built once per shape, for every M."""
    from kestrel.kernels.gemm_w4a8 import quantize_weight_w4
    from kestrel.kernels.gemm_w8a8 import quantize_weight_w8a8
    if kernel not in LOWBIT_KERNELS:
        raise ValueError(f"unknown low-bit kernel {kernel!r}; choose from {sorted(LOWBIT_KERNELS)}")
    w_fmt = LOWBIT_KERNELS[kernel][1]
    n = cold_copies(N * K * (1 if kernel.startswith("w8a8") else 2) // 2) if torch.device(device).type == "cuda" else 1
    ws = [torch.randn(N, K, device=device) * 0.02 for _ in range(n)]
    if kernel.startswith("w8a8"):
        qs = [quantize_weight_w8a8(w, w_fmt) for w in ws]
        return qs, qs[0][0].float() * qs[0][1].float().reshape(N, 1)
    qws = [quantize_weight_w4(w, w_fmt, 128).kernel_layout() for w in ws]  # tune what runs: the kernel packing
    w_ref = qws[0].dequantize()
    if not kernel.startswith("w4a8tcg"):
        return [(qw, ) for qw in qws], w_ref
    if w_fmt == "mxfp4":  # the Gluon fold kernel's planar twin + its folded multipliers
        fms = [qw.fold_mult() for qw in qws]
        if any(fm is None for fm in fms):
            raise ValueError("w4a8tcg-mxfp4: these random group scales span more than the fold allows")
        return [(qw.wna16(), *fm) for qw, fm in zip(qws, fms)], w_ref
    return [(qw.wna16(), ) for qw in qws], w_ref


def make_case(kernel: str, M: int, N: int, K: int, device="cuda", weights=None):
    """-> (run(cfg, i) computing that kernel on random data of this shape with weight copy i, the number of
    copies, ref fp32 [M, N]: the bf16 activations times copy 0's dequantized weight, tol: the relative error its
    activation quantization allows). weights: make_weights' result for this shape (built here if None)."""
    from kestrel.kernels.gemm_w4a4 import gemm_w4a4
    from kestrel.kernels.gemm_w4a8 import gemm_w4a8
    from kestrel.kernels.gemm_w8a8 import gemm_w8a8
    ops, w_ref = weights or make_weights(kernel, N, K, device)
    a_fmt, w_fmt = LOWBIT_KERNELS[kernel]
    x = torch.randn(M, K, device=device).to(torch.bfloat16)
    ref = x.float() @ w_ref.t()
    tol = 0.08 if a_fmt in (A_FP8, A_INT8) else 0.3  # 8-bit activations ~3 %, 4-bit ~9-12 % (RTN, random data)
    if kernel.startswith("w8a8"):
        a, s = aq.quant_int8(x) if w_fmt == "int8" else aq.quant_fp8(x)
        return (lambda cfg, i: gemm_w8a8(a, s, *ops[i], config=cfg)), len(ops), ref, tol
    if kernel.startswith("w4a8tcg"):
        from kestrel.kernels.gemm_w4a8 import TCG_PK, TCG_PP
        from kestrel.kernels.gemm_w4a8_tcg import gemm_w4a8_fold_tcg, gemm_w4a8_tcg
        if w_fmt == "mxfp4":  # the consumer options the dispatch (gemm_w4a8) launches with
            a, s = aq.quant_fp8(x)
            return (lambda cfg, i: gemm_w4a8_fold_tcg(a, s, *ops[i], block_m=cfg.BM, split_k=cfg.SPLIT_K,
                                                      stages=cfg.num_stages, kh=TCG_PP, pp=TCG_PP)), len(ops), ref, tol
        a, s = aq.quant_fp8(x, perm=TCG_PK)
        return (lambda cfg, i: gemm_w4a8_tcg(a, s, *ops[i], block_m=cfg.BM, split_k=cfg.SPLIT_K,
                                             stages=cfg.num_stages, pp=TCG_PP, a_perm=TCG_PK)), len(ops), ref, tol
    if kernel.startswith("w4a8"):
        a, s = aq.quant_fp8(x)
        return (lambda cfg, i: gemm_w4a8(a, s, *ops[i], config=cfg)), len(ops), ref, tol
    if w_fmt == "mxfp4":
        a, s = aq.quant_mxfp4(x)
        gs = None
    else:
        a, s, gs = aq.quant_nvfp4(x)
    return (lambda cfg, i: gemm_w4a4(a, s, *ops[i], gs, config=cfg)), len(ops), ref, tol


W_CODE = {"fp8": W_FP8, "int8": W_INT8, "int4": W_INT4, "mxfp4": W_FP4, "nvfp4": W_FP4}


def candidates(kernel: str, M: int, N: int, K: int, max_candidates: int | None = None) -> list[GemmConfig]:
    """the kernel's own heuristic first (the one it launches untuned), then the search space."""
    if kernel.startswith("w4a8tcg"):
        from kestrel.kernels.gemm_w4a8_tcg import tile_candidates
        out = tile_candidates(M, N, K)
        return out[:max_candidates] if max_candidates else out
    a_fmt, w = LOWBIT_KERNELS[kernel]
    w_fmt = W_CODE[w]
    h = heuristic_config(M, N, K, a_fmt, w_fmt)
    out = [h] + [c for c in candidate_configs(M, a_fmt, w_fmt) if c != h and K % (c.BK * c.SPLIT_K) == 0]
    return out[:max_candidates] if max_candidates else out


def _graph_us(fns) -> float:
    """µs per call in a CUDA graph rotating over the weight copies: what the engine (graph mode) and the benches
    see. do_bench would add the Python launch (descriptors, the Gluon launcher's argument handling) of calls that
    take ~50 µs on the GPU (the 70B shapes at M = 256), and rank configs by it."""
    from kestrel.kernels.timing import graph_time_us
    return graph_time_us(fns, calls=10, replays=5)


def tune_lowbit(kernel: str, shapes: list[tuple[int, int]], ms: list[int], progress=None,
                max_candidates: int | None = None, timer=None, device="cuda", save: bool = True) -> dict:
    """-> {"kernel|N|K|M": {"config", "us", "heuristic_us", "previous_us"}}; winners are stored in the cache when
    `save`. timer(fns) times one call per weight copy; the entry in use before is measured too (a stored winner is
    never slower than what it replaces), and a config whose output strays from the reference is never stored."""
    from kestrel.kernels.lowbit_tune import lookup
    timer = timer or _graph_us
    results = {}
    for N, K in shapes:
        weights = make_weights(kernel, N, K, device)  # once per shape: quantizing (and copying) is not per M
        for M in ms:
            run, n, ref, tol = make_case(kernel, M, N, K, device, weights)
            prev = lookup(kernel, M, N, K, nearest=False)
            cands = candidates(kernel, M, N, K, max_candidates)
            cands = cands + [prev] if prev is not None and prev not in cands else cands

            def measure(cfg):
                err = ((run(cfg, 0).float() - ref).norm() / ref.norm()).item()
                if not err <= tol:
                    raise ValueError(f"{kernel} {cfg}: relative error {err:.3g} against the reference")
                return timer([lambda i=i: run(cfg, i) for i in range(n)])
            best, best_t, times = fastest(cands, measure, progress)
            heur_t = times[0] if times else None  # candidates() puts the kernel's heuristic first
            prev_t = times[cands.index(prev)] if prev is not None else None
            if best is not None:
                if save:
                    store(kernel, M, N, K, best, best_t, heur_t)
                results[f"{kernel}|N{N}|K{K}|M{m_bucket(M)}"] = {"config": best.as_dict(), "us": best_t,
                                                                  "heuristic_us": heur_t, "previous_us": prev_t}
    return results


def run_cli(kernels: list[str], shapes: list[tuple[int, int]], ms: list[int], max_candidates: int | None) -> None:
    """the `kestrel tune --lowbit` path: progress bar, one line per winner."""
    if not torch.cuda.is_available():
        raise ValueError("kestrel tune needs a CUDA GPU (none is visible)")
    from tqdm import tqdm

    from kestrel.kernels.lowbit_tune import cache_path
    total = sum(len(candidates(k, m, n, kk, max_candidates)) for k in kernels for n, kk in shapes for m in ms)
    with tqdm(total=total, desc=f"tuning low-bit GEMMs on {torch.cuda.get_device_name()}", unit="cfg") as bar:
        for k in kernels:
            bar.set_postfix_str(k)
            for key, v in tune_lowbit(k, shapes, ms, progress=bar, max_candidates=max_candidates).items():
                tqdm.write(f"{key}: {v['us']:.1f} us (heuristic {v['heuristic_us']:.1f}) {v['config']}")
    print(f"wrote {cache_path()}")
