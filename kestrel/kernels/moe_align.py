"""MoE routing and token sort/align: which (token, slot) rows each expert block of the grouped GEMM reads.

All outputs have sizes fixed by (tokens, top_k, experts, block) alone — no host sync, so the MoE layer can be
captured in a CUDA graph. Padding slots hold the sentinel `num_tokens * top_k` and are masked in the kernel.
Three implementations with the same blocks: one single-CTA Triton launch for small slots x experts, the many-CTA
two-pass Triton align (moe_align_fast: atomic per-expert counts, then a scatter) above, and torch ops (the reference,
and the CPU path without Triton). The first and the last give identical (stable) output; the many-CTA one may order
an expert's slots differently (atomic order), which changes no GEMM result.
"""
import warnings

import torch
import triton
import triton.language as tl

# the single CTA's work grows with slots x experts: on the H200 (bench/results/moe_h200_run4.md) it costs 4.6-5.9 us
# up to 2048 (8 slots of 128-256 experts, 128 slots of 8), where the two-pass many-CTA align costs 7-9 us; above,
# the single CTA grows (15 us at 512 x 8, 27 us at 512 x 128, 130 us at 8192 x 128) and the many-CTA one stays at
# 7-16 us up to 32768 slots. The torch ops (47-131 us) serve the CPU only.
SINGLE_CTA_MAX_WORK = 2048


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool = True):
    """softmax over experts, keep the top_k -> (weights fp32 [M, k], expert ids int32 [M, k])."""
    E = router_logits.shape[-1]
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, {E}], got {top_k}")
    probs = torch.softmax(router_logits.float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w, ids.to(torch.int32)


def max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """upper bound on padded blocks: each expert that receives a slot wastes at most one partial block."""
    return triton.cdiv(num_slots, block_m) + min(num_experts, num_slots)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, npost_ptr, T, E, n_blocks,
                  BM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr):
    """one CTA: per-expert counts -> padded offsets -> block expert ids -> stable scatter of slot indices."""
    e_idx = tl.arange(0, BLOCK_E)
    t_idx = tl.arange(0, BLOCK_T)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for t0 in range(0, T, BLOCK_T):
        ids = tl.load(ids_ptr + t0 + t_idx, mask=t0 + t_idx < T, other=BLOCK_E)
        counts += tl.sum((ids[:, None] == e_idx[None, :]).to(tl.int32), axis=0)
    padded = (counts + BM - 1) // BM * BM
    cum = tl.cumsum(padded, axis=0)
    tl.store(npost_ptr, tl.sum(padded, axis=0))
    cum_blk = cum // BM
    for b0 in range(0, n_blocks, BLOCK_T):
        b = b0 + t_idx
        e_of_b = tl.sum((cum_blk[None, :] <= b[:, None]).to(tl.int32), axis=1)  # experts that end at or before b
        tl.store(expert_ids_ptr + b, tl.minimum(e_of_b, E - 1), mask=b < n_blocks)
    for p0 in range(0, n_blocks * BM, BLOCK_T):
        tl.store(sorted_ptr + p0 + t_idx, tl.zeros([BLOCK_T], tl.int32) + T, mask=p0 + t_idx < n_blocks * BM)
    tl.debug_barrier()  # the sentinel fill above must land before the scatter below overwrites it
    cursor = cum - padded
    for t0 in range(0, T, BLOCK_T):
        ids = tl.load(ids_ptr + t0 + t_idx, mask=t0 + t_idx < T, other=BLOCK_E)
        onehot = (ids[:, None] == e_idx[None, :]).to(tl.int32)
        base = tl.sum(onehot * cursor[None, :], axis=1)
        earlier = (ids[:, None] == ids[None, :]) & (t_idx[None, :] < t_idx[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)  # earlier slots of the same expert in this chunk (stable)
        tl.store(sorted_ptr + base + rank, t0 + t_idx, mask=t0 + t_idx < T)
        cursor += tl.sum(onehot, axis=0)


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, pos_ptr, sorted_ptr, T, E, fill_total,
                        BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr):
    """many CTAs, pass 1: this chunk's per-expert counts are added atomically to counts[E] (zeroed by the caller);
    the old value is where the chunk's slots of that expert start within the expert, so each slot learns its
    position (chunks land in atomic order, slots within a chunk in order). Also fills a stripe of the sentinels."""
    pid = tl.program_id(0)
    e_idx = tl.arange(0, BLOCK_E)
    t_idx = tl.arange(0, BLOCK_T)
    t = pid * BLOCK_T + t_idx
    ids = tl.load(ids_ptr + t, mask=t < T, other=BLOCK_E)
    onehot = (ids[:, None] == e_idx[None, :]).to(tl.int32)
    local = tl.sum(onehot, axis=0)
    base = tl.atomic_add(counts_ptr + e_idx, local, mask=(e_idx < E) & (local > 0))
    earlier = (ids[:, None] == ids[None, :]) & (t_idx[None, :] < t_idx[:, None])
    pos = tl.sum(onehot * base[None, :], axis=1) + tl.sum(earlier.to(tl.int32), axis=1)
    tl.store(pos_ptr + t, pos, mask=t < T)
    step = tl.num_programs(0) * BLOCK_T
    for f0 in range(pid * BLOCK_T, fill_total, step):
        tl.store(sorted_ptr + f0 + t_idx, tl.zeros([BLOCK_T], tl.int32) + T, mask=f0 + t_idx < fill_total)


@triton.jit
def _align_scatter_kernel(ids_ptr, counts_ptr, pos_ptr, sorted_ptr, expert_ids_ptr, npost_ptr, T, E, n_blocks,
                          BM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr):
    """pass 2: every CTA turns counts into padded expert offsets (E values: cheap to redo per CTA), scatters its
    chunk's slots, and writes a stripe of the block -> expert table."""
    pid = tl.program_id(0)
    e_idx = tl.arange(0, BLOCK_E)
    t_idx = tl.arange(0, BLOCK_T)
    counts = tl.load(counts_ptr + e_idx, mask=e_idx < E, other=0)
    padded = (counts + BM - 1) // BM * BM
    cum = tl.cumsum(padded, axis=0)
    start = cum - padded
    t = pid * BLOCK_T + t_idx
    ids = tl.load(ids_ptr + t, mask=t < T, other=BLOCK_E)
    onehot = (ids[:, None] == e_idx[None, :]).to(tl.int32)
    dest = tl.sum(onehot * start[None, :], axis=1) + tl.load(pos_ptr + t, mask=t < T, other=0)
    tl.store(sorted_ptr + dest, t, mask=t < T)
    if pid == 0:
        tl.store(npost_ptr, tl.sum(padded, axis=0))
    cum_blk = cum // BM
    step = tl.num_programs(0) * BLOCK_T
    for b0 in range(pid * BLOCK_T, n_blocks, step):
        b = b0 + t_idx
        e_of_b = tl.sum((cum_blk[None, :] <= b[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + b, tl.minimum(e_of_b, E - 1), mask=b < n_blocks)


def moe_align_fast(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """moe_align in two many-CTA Triton launches (+ a memset), any size, no host sync. Same blocks, block experts
    and num_post as moe_align_torch; within an expert the slots may come in another order (chunks land in atomic
    order), which changes nothing in the GEMM: each output row is computed from its own slot alone."""
    T = topk_ids.numel()
    dev = topk_ids.device
    if not topk_ids.is_cuda:
        _check_ids(topk_ids, num_experts)
    B = max_blocks(T, num_experts, block_m)
    sorted_ids = torch.empty(B * block_m, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(B, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    pos = torch.empty(max(T, 1), dtype=torch.int32, device=dev)
    flat = topk_ids.reshape(-1).to(torch.int32).contiguous()
    BLOCK_E = triton.next_power_of_2(num_experts)
    BLOCK_T = max(16, min(128, 8192 // BLOCK_E))
    grid = (max(1, triton.cdiv(T, BLOCK_T)),)
    _align_count_kernel[grid](flat, counts, pos, sorted_ids, T, num_experts, B * block_m,
                              BLOCK_E=BLOCK_E, BLOCK_T=BLOCK_T, num_warps=4)
    _align_scatter_kernel[grid](flat, counts, pos, sorted_ids, expert_ids, num_post, T, num_experts, B,
                                BM=block_m, BLOCK_E=BLOCK_E, BLOCK_T=BLOCK_T, num_warps=4)
    return sorted_ids, expert_ids, num_post


_TRITON_ALIGN_OK = [True]


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """topk_ids [M, k] -> (sorted_ids int32 [B * block_m], expert_ids int32 [B], num_post int32 [1]).

    sorted_ids lists the flat slot indices (token * k + j) grouped by expert, each expert's run padded to a
    multiple of block_m; expert_ids[b] is the expert of block b; num_post the number of valid (padded) rows.
    """
    from kestrel.kernels.act_quant import use_triton
    T = topk_ids.numel()
    if not (use_triton(topk_ids) and T > 0 and _TRITON_ALIGN_OK[0]):
        return moe_align_torch(topk_ids, num_experts, block_m)
    try:
        if T * triton.next_power_of_2(num_experts) <= SINGLE_CTA_MAX_WORK:
            return moe_align_single(topk_ids, num_experts, block_m)
        return moe_align_fast(topk_ids, num_experts, block_m)
    except Exception as ex:  # a Triton build that rejects the kernels: keep working on the torch path
        _TRITON_ALIGN_OK[0] = False
        warnings.warn(f"Triton moe_align unavailable ({ex!r}); using the torch implementation")
        return moe_align_torch(topk_ids, num_experts, block_m)


def moe_align_single(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """moe_align in one single-CTA launch (small slots x experts); same output as moe_align_torch (stable)."""
    T = topk_ids.numel()
    if not topk_ids.is_cuda:
        _check_ids(topk_ids, num_experts)
    B = max_blocks(T, num_experts, block_m)
    sorted_ids = torch.empty(B * block_m, dtype=torch.int32, device=topk_ids.device)
    expert_ids = torch.empty(B, dtype=torch.int32, device=topk_ids.device)
    num_post = torch.empty(1, dtype=torch.int32, device=topk_ids.device)
    BLOCK_E = triton.next_power_of_2(num_experts)
    BLOCK_T = max(16, min(128, 8192 // BLOCK_E))
    _align_kernel[(1,)](topk_ids.reshape(-1).to(torch.int32).contiguous(), sorted_ids, expert_ids, num_post,
                        T, num_experts, B, BM=block_m, BLOCK_E=BLOCK_E, BLOCK_T=BLOCK_T, num_warps=8)
    return sorted_ids, expert_ids, num_post


def _check_ids(topk_ids: torch.Tensor, num_experts: int):
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= num_experts):
        raise ValueError(f"expert ids must be in [0, {num_experts})")


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """moe_align with ~20 torch ops (any size; same output)."""
    flat = topk_ids.reshape(-1).long()
    T = flat.numel()
    if not flat.is_cuda:  # (no host sync on the GPU)
        _check_ids(flat, num_experts)
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    cum_pad = torch.cumsum(padded, 0)
    start_pad = cum_pad - padded
    start_cnt = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    dest = start_pad[e_sorted] + torch.arange(T, device=dev) - start_cnt[e_sorted]
    B = max_blocks(T, num_experts, block_m)
    sorted_ids = torch.full((B * block_m,), T, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    block_start = torch.arange(B, device=dev) * block_m
    expert_ids = torch.searchsorted(cum_pad, block_start, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, cum_pad[-1:].to(torch.int32)
