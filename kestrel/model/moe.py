"""Qwen-MoE family (Qwen1.5-MoE / Qwen2-MoE): the Llama-family decoder with each MLP replaced by routed SwiGLU
experts plus a sigmoid-gated shared expert. Expert weights are stacked as w13 [E, 2I, H] (gate rows, then up
rows) and w2 [E, H, I], the layout of kestrel.kernels.moe_layer.FusedMoE (and of transformers 5's Qwen2-MoE),
so the GPU path is two grouped GEMMs for all experts; the CPU path is the per-expert reference loop."""
from __future__ import annotations

import torch
from torch import nn

from kestrel.kernels.moe_align import route_topk

from .config import ModelConfig
from .layers import make_linear
from .llama import LlamaForCausalLM


class _SharedExpert(nn.Module):
    def __init__(self, hidden: int, inter: int, name: str):
        super().__init__()
        self.inter = inter
        self.gate_up_proj = make_linear(hidden, 2 * inter, False, name + ".gate_up_proj")
        self.down_proj = make_linear(inter, hidden, False, name + ".down_proj")

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class QwenMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, num_experts: int, top_k: int, moe_intermediate_size: int,
                 shared_expert_intermediate_size: int, norm_topk_prob: bool):
        super().__init__()
        H, E, inter = cfg.hidden_size, num_experts, moe_intermediate_size
        self.top_k, self.norm_topk_prob, self.num_experts = top_k, norm_topk_prob, E
        self.router = nn.Linear(H, E, bias=False)  # kept in float: routing is precision-sensitive and tiny
        self.w13 = nn.Parameter(torch.empty(E, 2 * inter, H), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(E, H, inter), requires_grad=False)
        self.shared_expert = _SharedExpert(H, shared_expert_intermediate_size, f"layers.{layer_idx}.shared_expert")
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)
        self._fused = None  # FusedMoE over w13/w2, built on first GPU use

    def reset_dummy(self, gen: torch.Generator, std: float) -> None:
        """Random expert weights for --load-format dummy (the builder fills the nn.Linear layers itself)."""
        self.w13.normal_(0.0, std, generator=gen)
        self.w2.normal_(0.0, std, generator=gen)
        self._fused = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_topk(self.router(x), self.top_k, self.norm_topk_prob)
        if x.is_cuda and x.dtype == torch.bfloat16:
            if self._fused is None:
                from kestrel.kernels.moe_layer import FusedMoE
                self._fused = FusedMoE.from_float(self.router.weight, self.w13, self.w2, self.top_k,
                                                  renormalize=self.norm_topk_prob)
            routed = self._fused(x, routing=(weights, ids))
        else:
            routed = self._experts_loop(x, weights, ids)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared


    def _experts_loop(self, x, weights, ids):
        """CPU path: each expert on the tokens routed to it, in x's dtype."""
        out = torch.zeros_like(x)
        inter = self.w2.shape[-1]
        for e in torch.unique(ids).tolist():
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            h = x[tok] @ self.w13[e].t()
            y = (nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ self.w2[e].t()
            out.index_add_(0, tok, y * weights[tok, slot, None].to(x.dtype))
        return out


class MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, num_experts: int, top_k: int, moe_intermediate_size: int,
                 shared_expert_intermediate_size: int, norm_topk_prob: bool = False):
        super().__init__(cfg)
        for i, layer in enumerate(self.layers):
            layer.mlp = QwenMoeBlock(cfg, i, num_experts, top_k, moe_intermediate_size,
                                     shared_expert_intermediate_size, norm_topk_prob)
