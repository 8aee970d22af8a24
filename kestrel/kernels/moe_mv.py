"""Grouped MoE GEMM for int4 weights in the WNA16 planar layout (kestrel/quant/packing.py), bf16 activations.

Why a second grouped kernel: at decode sizes (a few slots per expert) the GEMM is a weight stream, and the WNA16
decode kernel ("mv", gemm_wna16_small.py) streams planar int4 near copy bandwidth where lowbit_gemm's byte-packed
tiles do not. This is that kernel's K loop (its _mv_block: one [16, BN] word tile -> 8 fields of contiguous k, each a
K=16 MMA, the group scale applied to the partial product) with the grouped-GEMM prologue / epilogue of lowbit_gemm:
program (n tile, expert block, K split) reads its block's expert and token rows from moe_align's output and writes
(x routing weight) the slot rows. Split-K finishes in the same launch (gemm_wna16_small._finish: the last split of a
tile sums the fp32 partials in split order), so the output is written once, in bf16, with no zero-fill.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

from kestrel.kernels.gemm_wna16_small import _finish, _mv_block, _workspace
from kestrel.kernels.lowbit import round_bf16, unpack_nibbles
from kestrel.quant.packing import PLANE_ROWS, pack_codes, unpack_codes

EPW = 8  # int4 codes per int32 word
BLOCK_K = PLANE_ROWS * EPW  # K per planar block (128)


@dataclass
class PlanarW4:
    """int4 symmetric expert weights: qweight int32 [E, K // 8, N] planar codes c = q + 8, scales fp32 [E, K // g, N]."""
    qweight: torch.Tensor
    scales: torch.Tensor
    group: int

    @property
    def shape(self):
        E, kw, N = self.qweight.shape
        return E, N, kw * EPW

    def dequantize(self) -> torch.Tensor:
        """reference fp32 [E, N, K]."""
        E, N, K = self.shape
        out = []
        for e in range(E):
            v = (unpack_codes(self.qweight[e], 4, K) - 8).float()
            out.append(v * self.scales[e].float().t().repeat_interleave(self.group, dim=1))
        return torch.stack(out)

    def to(self, device):
        return PlanarW4(self.qweight.to(device), self.scales.to(device), self.group)


def _check_planar(K: int, group: int):
    if K % BLOCK_K or group % PLANE_ROWS or (group < BLOCK_K and BLOCK_K % group):
        raise ValueError(f"planar int4 needs K % {BLOCK_K} == 0 and a group that tiles the 16-row planes, "
                         f"got K={K}, group={group}")


def planar_from_codes(q: torch.Tensor, scale: torch.Tensor, group: int) -> PlanarW4:
    """q int [E, N, K] in -8..7, scale [E, N, K // group] -> PlanarW4."""
    _check_planar(q.shape[-1], group)
    qw = torch.stack([pack_codes((qe.to(torch.int32) + 8), 4) for qe in q])
    return PlanarW4(qw, scale.float().transpose(1, 2).contiguous(), group)


def planar_from_nibbles(packed: torch.Tensor, scale: torch.Tensor, group: int) -> PlanarW4:
    """two's complement int4 nibbles, uint8 [E, N, K // 2] (low nibble = even k), scale [E, N, K // group] ->
    PlanarW4; one expert at a time, so the int32 temporaries stay one expert large (DeepSeek-V3: 0.1 GB, not 30)."""
    _check_planar(packed.shape[-1] * 2, group)
    qw = torch.stack([pack_codes(unpack_nibbles(p).to(torch.int32) ^ 8, 4) for p in packed])  # c ^ 8 = q + 8
    return PlanarW4(qw, scale.float().transpose(1, 2).contiguous(), group)


@triton.jit
def _moe_mv_kernel(x_ptr, qw_ptr, s_ptr, y_ptr, ws_ptr, cnt_ptr, topk_w_ptr, sorted_ptr, expert_ptr, npost_ptr,
                   num_valid, a_div, out_div, N, K, stride_xm, stride_ym, stride_qe, stride_se, split_k,
                   GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                   NUM_STAGES: tl.constexpr, SWAP: tl.constexpr, DOT_F32: tl.constexpr, ASM: tl.constexpr,
                   MUL_ROUTED: tl.constexpr, REDUCE: tl.constexpr, KB: tl.constexpr, R: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    if pid_m * BLOCK_M >= tl.load(npost_ptr):  # padding blocks past the last expert's run
        return
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    tok = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = tok < num_valid
    a_rows = tl.where(row_ok, tok // a_div, 0).to(tl.int64)
    PB: tl.constexpr = R * 8
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_r = tl.arange(0, R)
    n_blocks = K // PB
    per_split = tl.cdiv(tl.cdiv(n_blocks, split_k), KB) * KB
    b0 = pid_k * per_split
    b1 = tl.minimum(b0 + per_split, n_blocks)
    qw_e = qw_ptr + expert * stride_qe
    s_e = s_ptr + expert * stride_se
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    q_ptrs = qw_e + offs_r[:, None] * N + offs_n[None, :]
    for b_step in tl.range(b0, b1, KB, num_stages=NUM_STAGES):
        for kb in tl.static_range(KB):  # KB word tiles per step: more bytes in flight per program
            b = b_step + kb
            nb_mask = n_mask & ((offs_n * 0 + b) < b1)
            q = tl.load(q_ptrs + b * R * N, mask=nb_mask[None, :], other=0)
            # format constexprs: 4-bit ints, 8 per word, symmetric (code offset 8), fp32 scales, groups along K
            acc = _mv_block(acc, q, q, b, b1, n_blocks, x_ptr, s_e, s_e, a_rows, offs_n, row_ok, nb_mask, K, N,
                            stride_xm, 4, 8, True, 1, 0, 8, False, 0, GROUP_SIZE, False, BLOCK_N, SWAP, True,
                            DOT_F32, ASM, KB > 1, False, R)
    if SWAP:
        acc = tl.trans(acc)
    if MUL_ROUTED:
        acc = acc * tl.load(topk_w_ptr + tok, mask=row_ok, other=0.0)[:, None]
    if REDUCE:  # sum over each token's k slots here: fp32 atomics into y[token] (zeroed), K splits included
        y_rows = (tok // out_div).to(tl.int64)
        tl.atomic_add(y_ptr + y_rows[:, None] * stride_ym + offs_n[None, :], acc,
                      mask=row_ok[:, None] & n_mask[None, :], sem="relaxed")  # only the sum is needed
    else:
        if DOT_F32 and not SPLIT and y_ptr.dtype.element_ty == tl.bfloat16:
            acc = round_bf16(acc)  # interpreter: its bf16 cast truncates, the GPU's rounds to nearest
        _finish(acc, y_ptr, ws_ptr, cnt_ptr, tok.to(tl.int64), offs_n, row_ok, n_mask, num_valid, N, stride_ym,
                pid_m * tl.num_programs(0) + pid_n, pid_k, split_k, SPLIT)


class DictConfig:
    """as_dict / from_dict for the grouped kernels' frozen config dataclasses (the tune cache stores the dict;
    keys a config does not have are ignored)."""
    def as_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict):
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


def check_launch(x: torch.Tensor, w: "PlanarW4", align, num_slots: int, out: torch.Tensor, bm: int,
                 reduce_k: int) -> tuple:
    """the argument checks the planar grouped kernels share (moe_mv, moe_tc, moe_tcg); zeroes `out` for
    reduce_k > 0 (each slot is added into its token's row). -> (E, N, K, expert blocks)."""
    sorted_ids, expert_ids, _ = align
    E, N, K = w.shape
    if x.shape[-1] != K or K % BLOCK_K or x.stride(-1) != 1:
        raise ValueError(f"x must be [tokens, {K}] (row-major) with K a multiple of {BLOCK_K}, got {tuple(x.shape)}")
    blocks = expert_ids.numel()
    if sorted_ids.numel() != blocks * bm:
        raise ValueError(f"the sort/align was made for another block size than BM={bm}")
    if reduce_k:
        if out.dtype != torch.float32 or out.shape[0] * reduce_k != num_slots:
            raise ValueError(f"reduce_k={reduce_k}: out must be fp32 [{num_slots // reduce_k}, N]")
        out.zero_()
    return E, N, K, blocks


@dataclass(frozen=True)
class MvConfig(DictConfig):
    """compute config of the planar grouped kernel (BM = rows per expert block, shared with moe_align)."""
    BM: int = 16
    BN: int = 128
    SPLIT_K: int = 1
    num_warps: int = 2
    num_stages: int = 3
    SWAP: int = 0  # 1: W is the MMA A operand ("mvs")
    KB: int = 1  # planar blocks per pipeline step


def grouped_gemm_planar(x: torch.Tensor, w: PlanarW4, align, num_slots: int, a_div: int, out: torch.Tensor,
                        cfg: MvConfig, topk_weights: torch.Tensor | None = None, reduce_k: int = 0) -> torch.Tensor:
    """out[slot] = x[slot // a_div] @ W[expert(slot)]^T (x routing weight) for every valid slot, one launch.
    x bf16/fp16 [tokens, K] contiguous, out [num_slots, N] (any float dtype). reduce_k > 0: out is fp32
    [num_slots // reduce_k, N] and receives the sum over each token's reduce_k slots (out[t] = sum_j slot t*k+j;
    zeroed here, filled by atomics: the order of the k additions is not fixed)."""
    sorted_ids, expert_ids, num_post = align
    E, N, K, blocks = check_launch(x, w, align, num_slots, out, cfg.BM, reduce_k)
    n_tiles = triton.cdiv(N, cfg.BN)
    split = max(1, min(cfg.SPLIT_K, K // BLOCK_K))
    on_gpu = x.is_cuda
    if reduce_k:
        ws, cnt = out, out
    elif split > 1:
        ws, cnt = _workspace(x.device, split * num_slots * N, blocks * n_tiles)
    else:
        ws, cnt = out, out
    tw = topk_weights if topk_weights is not None else out
    _moe_mv_kernel[(n_tiles, blocks, split)](
        x, w.qweight, w.scales, out, ws, cnt, tw, sorted_ids, expert_ids, num_post,
        num_slots, a_div, max(reduce_k, 1), N, K, x.stride(0), out.stride(0), w.qweight.stride(0),
        w.scales.stride(0), split,
        GROUP_SIZE=w.group, BLOCK_M=cfg.BM, BLOCK_N=cfg.BN, SPLIT=split > 1, NUM_STAGES=cfg.num_stages,
        SWAP=bool(cfg.SWAP), DOT_F32=not on_gpu, ASM=on_gpu, MUL_ROUTED=topk_weights is not None,
        REDUCE=reduce_k > 0, KB=cfg.KB,
        R=PLANE_ROWS, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out

