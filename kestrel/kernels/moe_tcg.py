"""Grouped MoE GEMM for planar int4 g128 experts (moe_mv.PlanarW4) at large token counts, in Gluon: the decode of
K step s+1 overlaps the asynchronous wgmma of step s ("tcg": the dense gemm_wna16_tcg.py loop, adapted to experts).

Why: moe_tc.py (Triton) decodes the weight tile into shared memory and waits on each wgmma right away (Triton 3.6
does not pipeline a dot whose operand is computed in the loop), so decode and MMA serialise inside a CTA; at
M = 1024 it reached 0.57x of Humming's MoE GEMM on Qwen3-30B-A3B's up projection (bench/results/moe_h200_run6.md).
Here the loop is written out as in the dense tcg kernel: a ring of STAGES loads, the decoded W tile double-buffered
in shared memory, warpgroup_mma(is_async) + warpgroup_mma_wait(1).

Differences from the dense kernel: the x rows of an expert block are gathered (token ids from moe_align), so x is
loaded with cp.async (one commit group per K step; TMA cannot gather on Hopper); the packed words and the fp32 group
scales come by TMA from 2-D views [E * K / 8, N] / [E * K / 128, N] at the expert's row offset. Epilogue as moe_tc:
routing weight, bf16 store into the slot rows or relaxed fp32 atomics into token rows (reduce_k).

Numerics as moe_tc DEC 1/2: (c - 8) * bf16(scale) rounded to bf16 once (packed bf16x2 PTX), fp32 accumulation.
GPU only (no interpreter for Gluon): moe_gemm falls back to moe_tc where `supports` is false.

This file is the host side (TcgConfig, `supports`, the launch); the kernels live one K loop per file:
moe_tcg_ws.py (WS 1 / 2, the serving default), moe_tcg_tcgp.py (SWAP 2), moe_tcg_persist.py (PERSIST 1),
moe_tcg_swap01.py (SWAP 0 / 1), and the addressing / ring loads / epilogue they share in moe_tcg_io.py.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kestrel.kernels.gemm_wna16_tcg import R
from kestrel.kernels.moe_mv import BLOCK_K, PlanarW4
# the kernels, one file per K loop (their shared addressing / loads / epilogue in moe_tcg_io.py)
from kestrel.kernels.moe_tcg_persist import _moe_tcgq_kernel
from kestrel.kernels.moe_tcg_swap01 import _moe_tcg_kernel, _moe_tcgs_kernel
from kestrel.kernels.moe_tcg_tcgp import _moe_tcgp_kernel
from kestrel.kernels.moe_tcg_ws import _moe_tcgw_kernel


@dataclass(frozen=True)
class TcgConfig:
    """compute config of the grouped Gluon kernel (BM = rows per expert block, shared with moe_align)."""
    BM: int = 64
    BN: int = 128
    num_warps: int = 8
    num_stages: int = 3  # depth of the load ring (x by cp.async, words + scales by TMA)
    GROUP_M: int = 8  # expert blocks that walk the N tiles together (0: all blocks of one N tile first)
    SWAP: int = 0  # 1: W decoded straight into the wgmma's register A operand, x^T the shared B (_moe_tcgs_kernel);
    # 2: the same as the dense swap kernel's loop (_moe_tcgp_kernel: one wgmma kept in flight, scales prefetched)
    REFILL: int = 0  # swapped kernel: 1 refills the previous step's ring slot after the pre-MMA barrier (one CTA
    # barrier per step instead of two). BROKEN on the H200 (err 0.25, session 4 R2): `supports` refuses it
    MAXNREG: int = 0  # > 0: register cap per thread (ptxas maxnreg), e.g. 128 for 2 CTAs of 8 warps per SM
    PROBE: int = 0  # SWAP 2 timing probe, WRONG results (benches only; `supports` refuses it): 1 skips the decode
    # (a constant A operand), 2 skips the per-step wgmma (decode kept alive by a sum, one wgmma at the end): which of
    # decode and MMA bounds the loop
    PERSIST: int = 0  # SWAP 2: 1 = one program per SM walking its tiles through one load ring (_moe_tcgq_kernel)
    # 2 = the same with a nested tile / K-step consumer loop (_consume_nested: no C7517; opt-in, not GPU-run yet)
    WS: int = 0  # SWAP 2: 1 = a loader partition feeds the ring, mbarrier hand-over (_moe_tcgw_kernel); 2 the same
    # without the fence before the slot release (one partition barrier a step instead of two)
    LOOP: int = 0  # SWAP 2 (tcgp / WS): 2 = the K loop without the register-A race (two wgmma a step, each A
    # rewritten only after its wgmma retired: _ws_consume_halves, _tcgp_kloop2; WS needs BN >= 32 warps); 0 = the
    # one-A loop of sessions 5-10 (writes the in-flight wgmma's A registers: right on the H200 so far by ptxas'
    # schedule only)
    SPLIT_K = 1  # no K split (class constant, as TcConfig)

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict) -> "TcgConfig":
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


LAST_COMPILED = [None]  # the compiled kernel of the last launch (benches log its registers / spills / smem)


def compiled_stats() -> dict:
    """registers, spills and shared memory of the last launched kernel (what decides CTAs per SM)."""
    k = LAST_COMPILED[0]
    md = getattr(k, "metadata", None)
    return {"regs": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None),
            "smem": getattr(md, "shared", None)}


@functools.lru_cache(maxsize=None)
def _num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def loop_ok(cfg: TcgConfig) -> bool:
    """cfg.LOOP is one the kernel has: 0 anywhere; 2 on the SWAP 2 loops (tcgp: row or K halves; WS and
    persistent: row halves only, BN >= 32 warps)."""
    return cfg.LOOP == 0 or (cfg.LOOP == 2 and cfg.SWAP == 2
                             and (not (cfg.WS or cfg.PERSIST) or cfg.BN >= 32 * cfg.num_warps))


def supports(x: torch.Tensor, w: PlanarW4, cfg: TcgConfig) -> bool:
    """Hopper, bf16 row-major x with 16-byte aligned rows, int4 g128 planar weights, a tile the kernel handles."""
    E, N, K = w.shape
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.stride(-1) == 1 and x.stride(0) % 8 == 0
            and x.data_ptr() % 16 == 0 and w.group == BLOCK_K and K % BLOCK_K == 0 and N % 4 == 0
            and w.qweight.is_contiguous() and w.scales.is_contiguous() and w.scales.dtype == torch.float32
            and (cfg.BM in ((32, 64, 128) if cfg.SWAP else (64, 128)) or (cfg.WS and cfg.BM in (80, 96)))
            and cfg.BN in (64, 128, 256)
            and cfg.num_warps in (4, 8)
            and (not cfg.SWAP or (cfg.BN >= 16 * cfg.num_warps and cfg.num_stages >= 2))
            and not cfg.PROBE  # timing probes compute wrong results
            and not cfg.REFILL  # R2 (H200): REFILL=1 gave wrong results (err 0.25) and was slower: disabled
            # session 5 R1 (H200): the tcgp loop measured wrong with a 3-deep ring (err 0.07 on three shapes; cause
            # not found: the ring indexing reads right), right (same err as SWAP 1, 2.8e-3) and faster with 4
            and (cfg.SWAP != 2 or cfg.num_stages >= 4)
            and (not cfg.PERSIST or (cfg.SWAP == 2 and cfg.PERSIST <= 2))
            and (not cfg.WS or (cfg.SWAP == 2 and not cfg.PERSIST and cfg.WS <= 2))
            and loop_ok(cfg)
            and torch.cuda.get_device_capability(x.device)[0] == 9)


def grouped_gemm_planar_tcg(x: torch.Tensor, w: PlanarW4, align, num_slots: int, a_div: int, out: torch.Tensor,
                            cfg: TcgConfig, topk_weights: torch.Tensor | None = None,
                            reduce_k: int = 0) -> torch.Tensor:
    """same contract as moe_tc.grouped_gemm_planar_tc (caller checks `supports`)."""
    sorted_ids, expert_ids, num_post = align
    E, N, K = w.shape
    blocks = expert_ids.numel()
    if sorted_ids.numel() != blocks * cfg.BM:
        raise ValueError(f"the sort/align was made for another block size than BM={cfg.BM}")
    if reduce_k:
        if out.dtype != torch.float32 or out.shape[0] * reduce_k != num_slots:
            raise ValueError(f"reduce_k={reduce_k}: out must be fp32 [{num_slots // reduce_k}, N]")
        out.zero_()
    r, bn = R.value, cfg.BN
    lay = gl.NVMMASharedLayout.get_default_for
    q_desc = TensorDescriptor.from_tensor(w.qweight.view(E * K // 8, N), [r, bn], lay([r, bn], gl.int32))
    s_desc = TensorDescriptor.from_tensor(w.scales.view(E * (K // BLOCK_K), N), [1, bn], lay([1, bn], gl.float32))
    tw = topk_weights if topk_weights is not None else out
    grid = (blocks * -(-N // bn),)
    # the kernels share one argument order: x, the weight operands (SWAP 0 / 1 also the scales' descriptor), then
    # the routing / output tail, then (all but the persistent one) the allocated expert-block count
    tail = (out, tw, sorted_ids, expert_ids, num_post, num_slots, a_div, max(reduce_k, 1), N, K, x.stride(0),
            out.stride(0))
    meta = dict(BLOCK_M=cfg.BM, BLOCK_N=bn, STAGES=cfg.num_stages, GROUP_M=cfg.GROUP_M,
                MUL_ROUTED=topk_weights is not None, REDUCE=reduce_k > 0, num_warps=cfg.num_warps)
    if cfg.MAXNREG:
        meta["maxnreg"] = cfg.MAXNREG
    if cfg.WS:
        kern, args = _moe_tcgw_kernel, (x, q_desc, w.scales, *tail, blocks)
        meta["RELEASE"] = cfg.WS
        meta["LOOP"] = cfg.LOOP
    elif cfg.PERSIST:  # the grid bound by the SMs; the kernel reads the real block count (num_post)
        kern, args = _moe_tcgq_kernel, (x, q_desc, w.scales, *tail)
        grid = (min(grid[0], _num_sms(x.device)),)
        meta["LOOP"] = cfg.LOOP
        if cfg.PERSIST == 2:
            meta["NESTED"] = 1
    elif cfg.SWAP == 2:
        kern, args = _moe_tcgp_kernel, (x, q_desc, w.scales, *tail, blocks)
        meta["PROBE"] = cfg.PROBE
        meta["LOOP"] = cfg.LOOP
    elif cfg.SWAP == 1:
        kern, args = _moe_tcgs_kernel, (x, q_desc, s_desc, w.scales, *tail, blocks)
        meta["EARLY_REFILL"] = bool(cfg.REFILL)
    else:
        kern, args = _moe_tcg_kernel, (x, q_desc, s_desc, *tail, blocks)
    LAST_COMPILED[0] = None  # (a launch that fails to compile leaves no stale stats)
    LAST_COMPILED[0] = kern[grid](*args, **meta)
    return out
