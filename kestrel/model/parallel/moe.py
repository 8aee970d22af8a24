"""Expert-parallel MoE block: experts sharded over ranks, tokens moved to their experts and back with all-to-all.

Per forward, on every rank: route the local tokens (softmax top-k over the replicated router), pick a physical copy
of each chosen expert (copies of a hot expert share its tokens, see eplb.py), sort the (token, expert) pairs by
owning rank, exchange counts, all-to-all the token rows (dispatch), run the local experts, all-to-all the outputs
back (combine), and sum them weighted by the routing weights. Each rank brings its own tokens (data-parallel
attention) and may bring none: it still joins both all-to-alls, so ranks stay in lockstep.

Weights: SwiGLU experts, w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I], as kestrel.kernels.moe_layer.
The local experts run as a per-expert loop of matmuls (CPU, any dtype), or through kestrel's fused grouped-GEMM
MoE kernel (bf16; the default on GPUs, `use_kernel`). With a group of size 1 this is a plain single-device MoE block.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .distributed import ParallelGroup
from .eplb import ExpertPlacement, contiguous_placement, plan_placement


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool):
    """softmax over experts, keep the top_k -> (weights fp32 [M, k], ids int64 [M, k])."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w, ids


class ExpertParallelMoE(nn.Module):
    """tokens="dispatch": each rank brings its own tokens (data-parallel attention), all-to-all moves them.
    tokens="replicated": every rank holds the same tokens (tensor-parallel attention); each computes only the
    pairs whose expert copy it holds and returns that partial sum, which the caller all-reduces (once, together
    with any other partial sums of the block), so no all-to-all is needed."""

    def __init__(self, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, group: ParallelGroup,
                 renormalize: bool = True, placement: ExpertPlacement | None = None, use_kernel: bool | None = None,
                 tokens: str = "dispatch"):
        super().__init__()
        if tokens not in ("dispatch", "replicated"):
            raise ValueError(f"tokens must be 'dispatch' or 'replicated', got {tokens!r}")
        self.tokens = tokens
        E, I2, H = w13.shape
        if router.shape != (E, H) or w2.shape != (E, H, I2 // 2):
            raise ValueError(f"router must be [E, H] = {(E, H)} and w2 [E, H, I] = {(E, H, I2 // 2)}; got "
                             f"{tuple(router.shape)} and {tuple(w2.shape)}")
        if not 1 <= top_k <= E:
            raise ValueError(f"top_k must be in [1, {E}], got {top_k}")
        self.num_experts, self.hidden, self.inter, self.top_k = E, H, I2 // 2, top_k
        self.group, self.renormalize, self.use_kernel = group, renormalize, use_kernel
        self.router = nn.Parameter(router.detach().clone(), requires_grad=False)
        # tokens routed to each logical expert since the last rebalance (this rank's tokens only)
        self.register_buffer("expert_load", torch.zeros(E, dtype=torch.long, device=router.device), persistent=False)
        self._place(placement or contiguous_placement(E, group.size), w13, w2)

    def _place(self, placement: ExpertPlacement, w13_full: torch.Tensor, w2_full: torch.Tensor) -> None:
        if placement.num_logical != self.num_experts or placement.num_ranks != self.group.size:
            raise ValueError("expert placement does not match this MoE block / expert-parallel group")
        self.placement = placement
        local = torch.tensor(placement.local_experts(self.group.rank), device=w13_full.device)
        self.w13 = nn.Parameter(w13_full[local].clone(), requires_grad=False)  # [S, 2I, H]
        self.w2 = nn.Parameter(w2_full[local].clone(), requires_grad=False)  # [S, H, I]
        reps = placement.replicas()
        width = max(len(r) for r in reps)
        table = torch.tensor([r + [r[0]] * (width - len(r)) for r in reps], dtype=torch.long)
        self.register_buffer("replica_table", table.to(w13_full.device), persistent=False)
        self.register_buffer("num_replicas", torch.tensor([len(r) for r in reps], device=w13_full.device),
                             persistent=False)
        self._fused = None

    # ---- expert-parallel load balancing ----
    def global_load(self) -> torch.Tensor:
        """Token counts per logical expert summed over the group."""
        return self.group.all_reduce(self.expert_load.clone())

    @torch.no_grad()
    def rebalance(self, num_redundant: int, load: torch.Tensor | None = None) -> ExpertPlacement:
        """Re-place experts (with `num_redundant` hot copies) for the load seen so far (or `load`). Collective:
        every rank calls it. The weights travel by all-gather of each rank's slots."""
        load = self.global_load() if load is None else load
        new = plan_placement(load.cpu(), self.group.size, num_redundant)
        S = self.placement.slots_per_rank
        w13_all = self.group.all_gather_cat(self.w13.data, 0)  # [size * S, 2I, H], physical order
        w2_all = self.group.all_gather_cat(self.w2.data, 0)
        first = [r[0] for r in self.placement.replicas()]  # one physical copy of each logical expert
        idx = torch.tensor(first, device=w13_all.device)
        assert w13_all.shape[0] == self.group.size * S
        self._place(new, w13_all[idx], w2_all[idx])
        self.expert_load.zero_()
        return new

    # ---- forward ----
    def _local_experts(self, x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """x [R, H] rows for local slots `slot` [R] -> expert outputs [R, H] (unweighted)."""
        use_kernel = x.is_cuda if self.use_kernel is None else self.use_kernel  # GPU: the fused grouped GEMM
        if use_kernel and x.shape[0]:
            return self._kernel_experts(x, slot)
        y = torch.empty_like(x)
        for s in slot.unique().tolist():
            rows = (slot == s).nonzero(as_tuple=True)[0]
            h = x[rows] @ self.w13[s].t()
            y[rows] = (F.silu(h[:, : self.inter]) * h[:, self.inter:]) @ self.w2[s].t()
        return y

    def _kernel_experts(self, x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        from kestrel.kernels.moe_layer import FusedMoE

        if self._fused is None:  # local slots as the experts of a top-1 fused MoE with routing weight 1
            S = self.w13.shape[0]
            self._fused = FusedMoE.from_float(torch.zeros(S, self.hidden, device=x.device), self.w13.data,
                                              self.w2.data, top_k=1)
        ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
        return self._fused(x.to(torch.bfloat16), routing=(ones, slot.view(-1, 1).to(torch.int32))).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        M, g = x.shape[0], self.group
        topk_w, topk_ids = route_topk(x @ self.router.t().to(x.dtype), self.top_k, self.renormalize)
        flat = topk_ids.reshape(-1)
        self.expert_load += torch.bincount(flat, minlength=self.num_experts)
        tok = torch.arange(M, device=x.device).repeat_interleave(self.top_k)
        # spread a replicated expert's pairs over its copies (round-robin over the pair index)
        pick = torch.arange(flat.numel(), device=x.device) % self.num_replicas[flat]
        phys = self.replica_table[flat, pick]
        S = self.placement.slots_per_rank
        dest = phys // S
        if self.tokens == "replicated":  # same pairs on every rank: keep the ones whose expert copy is here
            mine = (dest == g.rank).nonzero(as_tuple=True)[0]
            y = self._local_experts(x[tok[mine]], (phys % S)[mine])
            w = topk_w.reshape(-1)[mine].unsqueeze(1).to(y.dtype)
            return torch.zeros_like(x).index_add_(0, tok[mine], y * w)  # partial: the caller all-reduces
        order = torch.argsort(dest, stable=True)
        send = torch.bincount(dest, minlength=g.size)
        recv = g.exchange_counts(send)
        send_l, recv_l = send.tolist(), recv.tolist()
        x_in = g.all_to_all(x[tok[order]], send_l, recv_l)  # dispatch
        slot_in = g.all_to_all((phys % S)[order], send_l, recv_l)
        y_in = self._local_experts(x_in, slot_in)
        y_back = g.all_to_all(y_in, recv_l, send_l)  # combine
        y = torch.empty_like(y_back)
        y[order] = y_back
        w = topk_w.reshape(-1, 1).to(y.dtype)
        return torch.zeros_like(x).index_add_(0, tok, y * w)


class ParallelQwenMoeBlock(nn.Module):
    """kestrel.model.moe.QwenMoeBlock with its routed experts spread over the group.

    tokens="replicated" (inside tensor parallelism): routed experts split by expert, the shared expert split
    Megatron-style; both partial sums go through one all-reduce. tokens="dispatch" (data-parallel attention):
    routed experts via all-to-all, the shared expert replicated (no communication)."""

    def __init__(self, block: nn.Module, group: ParallelGroup, tokens: str, placement: ExpertPlacement | None = None):
        super().__init__()
        from .linear import ColumnParallelLinear, RowParallelLinear

        self.group, self.tokens = group, tokens
        self.experts = ExpertParallelMoE(block.router.weight.detach(), block.w13.data, block.w2.data, block.top_k,
                                         group, renormalize=block.norm_topk_prob, placement=placement, tokens=tokens)
        self.shared_expert_gate = block.shared_expert_gate
        se = block.shared_expert
        if tokens == "replicated":
            inter = se.inter
            self.shared_gate_up = ColumnParallelLinear.from_full(se.gate_up_proj, group, segment_sizes=[inter, inter])
            down = RowParallelLinear.from_full(se.down_proj, group)
            self.shared_down = down.local  # reduced together with the routed partial sum
            self.shared_inter = inter // group.size
        else:
            self.shared_expert = se

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.shared_expert_gate(x))
        if self.tokens == "dispatch":
            return self.experts(x) + gate * self.shared_expert(x)
        g, u = self.shared_gate_up(x).split(self.shared_inter, dim=-1)
        partial = self.experts(x) + gate * self.shared_down(F.silu(g) * u)
        return self.group.all_reduce(partial)


def is_moe_block(m: nn.Module) -> bool:
    return all(hasattr(m, a) for a in ("router", "w13", "w2", "top_k", "shared_expert"))


@torch.no_grad()
def expert_parallelize(model: nn.Module, group: ParallelGroup, tokens: str = "dispatch",
                       placement: ExpertPlacement | None = None) -> int:
    """Replace every Qwen-MoE block of `model` by its expert-parallel form, in place; returns how many."""
    n = 0
    for layer in model.layers:
        if is_moe_block(layer.mlp):
            layer.mlp = ParallelQwenMoeBlock(layer.mlp, group, tokens, placement)
            n += 1
    return n
