"""MoE routing and token sort/align: which (token, slot) rows each expert block of the grouped GEMM reads.

All outputs have sizes fixed by (tokens, top_k, experts, block) alone — no host sync, so the MoE layer can be
captured in a CUDA graph. Padding slots hold the sentinel `num_tokens * top_k` and are masked in the kernel.
"""
import torch
import triton


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


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """topk_ids [M, k] -> (sorted_ids int32 [B * block_m], expert_ids int32 [B], num_post int32 [1]).

    sorted_ids lists the flat slot indices (token * k + j) grouped by expert, each expert's run padded to a multiple
    of block_m; expert_ids[b] is the expert of block b; num_post the number of valid (padded) rows.
    """
    flat = topk_ids.reshape(-1).long()
    T = flat.numel()
    if not flat.is_cuda and T and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):  # no sync on GPU
        raise ValueError(f"expert ids must be in [0, {num_experts})")
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
