"""Large-M dense W8A8 (fp8 or int8, per-token x per-channel scales): TMA tile loads, optionally persistent CTAs.

Why a second kernel: at M >= 128 the pointer-based kernel in lowbit_gemm spends issue slots on address arithmetic
and cp.async, and lands well short of cuBLASLt's fp8 rate. TMA moves whole [rows, BK] boxes with one instruction
(out-of-range rows / columns read as zero and are clipped on store, so no masks), which is what Hopper GEMMs need to
keep the wgmma pipe fed. Both operands are K-major boxes (W is stored [N, K]), as fp8 / int8 wgmma requires.
Persistent mode: one CTA per SM walks tiles in the grouped (L2-friendly) order.
"""
import torch
import triton
import triton.language as tl

from kestrel.kernels.lowbit import round_bf16


@triton.jit
def _w8a8_tma_kernel(a_desc, w_desc, c_desc, as_ptr, ws_ptr, M, N, K, num_progs,
                     INT8: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     GROUP_M: tl.constexpr, OUT_DT: tl.constexpr):
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BK)
    for tile in range(tl.program_id(0), num_tiles, num_progs):
        group = GROUP_M * num_pid_n
        first_m = (tile // group) * GROUP_M
        gsize = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % group) % gsize
        pid_n = (tile % group) // gsize
        om = pid_m * BM
        on = pid_n * BN
        if INT8:
            acc = tl.zeros((BM, BN), tl.int32)
        else:
            acc = tl.zeros((BM, BN), tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([om, ki * BK])
            w = w_desc.load([on, ki * BK])
            if INT8:
                acc = tl.dot(a, w.T, acc, out_dtype=tl.int32)
            else:
                acc = tl.dot(a, w.T, acc)
        rm = om + tl.arange(0, BM)
        rn = on + tl.arange(0, BN)
        out = acc.to(tl.float32) * tl.load(as_ptr + rm, mask=rm < M, other=0.0)[:, None]
        out = out * tl.load(ws_ptr + rn, mask=rn < N, other=0.0)[None, :]
        if OUT_DT == 0:
            c_desc.store([om, on], round_bf16(out).to(tl.bfloat16))
        elif OUT_DT == 1:
            c_desc.store([om, on], out.to(tl.float16))
        else:
            c_desc.store([om, on], out)


_OUT_DT = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def tma_ok(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> bool:
    """TMA boxes need contiguous rows with 16-byte aligned strides and base pointers."""
    return out.dtype in _OUT_DT and all(t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
               and t.data_ptr() % 16 == 0 for t in (a, w, out))


def num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def launch_tma(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor,
               cfg) -> torch.Tensor:
    """out[M, N] = (a * a_scale[M]) @ (w * w_scale[N])^T; a, w both fp8 or both int8 (K contiguous)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    M, K = a.shape
    N = w.shape[0]
    a_desc = TensorDescriptor.from_tensor(a, [cfg.BM, cfg.BK])
    w_desc = TensorDescriptor.from_tensor(w, [cfg.BN, cfg.BK])
    c_desc = TensorDescriptor.from_tensor(out, [cfg.BM, cfg.BN])
    tiles = triton.cdiv(M, cfg.BM) * triton.cdiv(N, cfg.BN)
    progs = min(tiles, num_sms(a.device)) if cfg.TMA == 2 else tiles
    _w8a8_tma_kernel[(progs,)](a_desc, w_desc, c_desc, a_scale, w_scale, M, N, K, progs,
                               INT8=a.dtype == torch.int8, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M,
                               OUT_DT=_OUT_DT[out.dtype], num_warps=cfg.num_warps,
                               num_stages=cfg.num_stages)
    return out
