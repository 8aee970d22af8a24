"""Fused MoE layer: router top-k -> token sort/align -> grouped GEMM up/gate -> SiLU·mul -> grouped GEMM down (x routing
weight) -> sum over the k slots of each token. Two grouped launches for all experts, whatever the format.

`ref_moe` is the plain per-expert loop (dequantized weights, fp32) that the tests and benchmarks compare against.
"""
import torch

from kestrel.kernels import act_quant
from kestrel.kernels.moe_align import moe_align, route_topk
from kestrel.kernels.moe_gemm import (ExpertWeights, check_pair, grouped_gemm, moe_config, moe_configs, quant_act,
                                      quantize_experts)


class FusedMoE(torch.nn.Module):
    """Mixtral / Qwen-MoE / DeepSeek-style routed experts. w13: [E, 2I, H] (gate rows then up rows), w2: [E, H, I]."""

    def __init__(self, router: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights, top_k: int, act: str = "bf16",
                 renormalize: bool = True):
        super().__init__()
        check_pair(act, w13)
        check_pair(act, w2)
        E, I2, H = w13.shape
        if w2.shape != (E, H, I2 // 2):
            raise ValueError(f"w2 must be [E, H, I] = {(E, H, I2 // 2)}, got {w2.shape}")
        if router.shape != (E, H):
            raise ValueError(f"router must be [E, H] = {(E, H)}, got {tuple(router.shape)}")
        self.router = router
        self.w13, self.w2, self.top_k, self.act, self.renormalize = w13, w2, top_k, act, renormalize
        self.num_experts, self.hidden, self.inter = E, H, I2 // 2
        # the down GEMM adds each slot into its token's row (fp32 atomics) instead of writing [T, H]
        # for a separate sum; the k additions then land in no fixed order (last-bit differences between runs)
        self.fused_reduce = True

    @classmethod
    def from_float(cls, router, w13, w2, top_k: int, weight_fmt: str = "bf16", act: str = "bf16", group: int = 128,
                   renormalize: bool = True, planar: bool | None = None):
        """planar: int4 weights in the WNA16 planar layout (moe_mv kernel; bf16 activations). Default: where it
        applies (int4 x bf16, K of both projections a multiple of 128): faster than the byte-packed layout at every
        measured M on the H200."""
        if planar is None:
            planar = (weight_fmt, act) == ("int4", "bf16") and w13.shape[-1] % 128 == 0 and w2.shape[-1] % 128 == 0 \
                and group % 16 == 0 and (group >= 128 or 128 % group == 0)
        return cls(router.to(torch.bfloat16), quantize_experts(w13, weight_fmt, group, planar=planar),
                   quantize_experts(w2, weight_fmt, group, planar=planar), top_k, act, renormalize)

    def to(self, device):
        self.router = self.router.to(device)
        self.w13, self.w2 = self.w13.to(device), self.w2.to(device)
        return self

    def route(self, x: torch.Tensor):
        return route_topk(x @ self.router.t().to(x.dtype), self.top_k, self.renormalize)

    def plan(self, topk_ids: torch.Tensor):
        """the token sort/align for this routing (what forward computes first); reusable across calls."""
        cfg = moe_config(topk_ids.numel(), self.num_experts, self.act, planar=self.w13.planar is not None)
        return moe_align(topk_ids, self.num_experts, cfg.BM)

    def forward(self, x: torch.Tensor, routing=None, align=None) -> torch.Tensor:
        """x [M, H] -> [M, H]. routing: optional precomputed (topk_weights, topk_ids); align: optional precomputed
        plan(topk_ids) of that routing (benchmarks time the layer with and without the sort/align)."""
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"FusedMoE expects x [tokens, {self.hidden}], got {tuple(x.shape)}")
        M = x.shape[0]
        if M == 0:
            return torch.empty_like(x)
        topk_w, topk_ids = self.route(x) if routing is None else routing
        if not act_quant.use_triton(x):
            return ref_moe(x, topk_w, topk_ids, self.w13.dequantize(), self.w2.dequantize(), self.act).to(x.dtype)
        T = M * self.top_k
        cfg, cfg2 = moe_configs(M, self.top_k, self.num_experts, self.act, self.w13, self.w2)
        if align is None:
            align = moe_align(topk_ids, self.num_experts, cfg.BM)
        h = torch.empty((T, 2 * self.inter), dtype=torch.bfloat16, device=x.device)
        grouped_gemm(quant_act(x, self.act), self.w13, align, T, self.top_k, h, cfg)
        if self.act == "fp8":
            q, s = act_quant.silu_mul_fp8(h)  # activation + its quantization in one pass
            from kestrel.kernels.lowbit_gemm import A_FP8, Operand
            a2 = Operand(A_FP8, q, s)
        else:
            a2 = quant_act(act_quant.silu_mul(h), self.act)
        tw = topk_w.reshape(-1).float().contiguous()
        if self.fused_reduce:  # the down GEMM sums each token's k slots itself
            y = torch.empty((M, self.hidden), dtype=torch.float32, device=x.device)
            grouped_gemm(a2, self.w2, align, T, 1, y, cfg2, topk_weights=tw, reduce_k=self.top_k)
            return y.to(x.dtype)
        y = torch.empty((T, self.hidden), dtype=torch.float32, device=x.device)
        grouped_gemm(a2, self.w2, align, T, 1, y, cfg2, topk_weights=tw)
        return y.view(M, self.top_k, self.hidden).sum(1).to(x.dtype)


def _fake_quant(x: torch.Tensor, act: str) -> torch.Tensor:
    """quantize-dequantize with the CPU reference quantizers (what the kernel sees, computed independently)."""
    if act == "bf16":
        return x.to(torch.bfloat16).float()
    if act == "fp8":
        return act_quant.dequant_8bit(*act_quant.ref_quant_fp8(x))
    if act == "int8":
        return act_quant.dequant_8bit(*act_quant.ref_quant_int8(x))
    if act == "mxfp4":
        return act_quant.dequant_mxfp4(*act_quant.ref_quant_mxfp4(x))
    return act_quant.dequant_nvfp4(*act_quant.ref_quant_nvfp4(x))


def ref_moe(x, topk_w, topk_ids, w13, w2, act: str = "bf16") -> torch.Tensor:
    """Plain per-expert loop in fp32 on dequantized weights [E, 2I, H] / [E, H, I]."""
    M, H = x.shape
    I = w2.shape[-1]
    out = torch.zeros((M, H), dtype=torch.float32, device=x.device)
    xq = _fake_quant(x.float(), act)
    for e in range(w13.shape[0]):
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = xq[tok] @ w13[e].float().t()
        h = h.to(torch.bfloat16).float()  # the kernel writes the up-projection in bf16
        a = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
        if act == "bf16":
            a = a.to(torch.bfloat16).float()
        y = _fake_quant(a, act) @ w2[e].float().t()
        out.index_add_(0, tok, y * topk_w[tok, slot, None].float())
    return out
