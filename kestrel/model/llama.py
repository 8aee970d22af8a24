"""Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2) over a flattened batch of tokens.

The model never sees padding or a batch dimension: `input_ids`/`positions` are [T] for all sequences of a step
concatenated. Attention over the paged KV cache is delegated to `ctx.attention(layer_idx, q, k, v)`, supplied by
the engine's attention backend, so this file has no knowledge of caches or devices. q/k/v and gate/up are fused
into one matmul each (fewer, larger GEMMs)."""
from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .layers import RMSNorm, make_linear
from .rope import RotaryEmbedding


def _fused():
    """kestrel/kernels/rope_silu.py, imported on first CUDA use (Triton stays out of CPU-only imports)."""
    from kestrel.kernels import rope_silu
    return rope_silu


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = make_linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias, f"layers.{layer_idx}.qkv_proj")
        self.o_proj = make_linear(self.q_size, cfg.hidden_size, cfg.o_bias, f"layers.{layer_idx}.o_proj")
        self.sliding_window = cfg.layer_window(layer_idx)

    def forward(self, cos_sin, x, ctx):
        qkv = self.qkv_proj(x)
        t = qkv.shape[0]
        # rotate q and k heads in one pass (fewer ops per layer: the CPU decode step is op-overhead bound)
        qk_in = qkv[:, :self.q_size + self.kv_size].view(t, -1, self.head_dim)
        # CUDA: one kernel reading the strided slice (PyTorch's ops fall back to slow generic kernels when t > 1)
        if qk_in.is_cuda and _fused().ENABLED:
            qk = _fused().rope(qk_in, *cos_sin)
        else:
            qk = RotaryEmbedding.apply(qk_in, cos_sin)
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        out = ctx.attention(self.layer_idx, q, k, v)  # [T, num_heads * head_dim]
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = make_linear(cfg.hidden_size, 2 * self.inter, cfg.mlp_bias, f"layers.{layer_idx}.gate_up_proj")
        self.down_proj = make_linear(self.inter, cfg.hidden_size, cfg.mlp_bias, f"layers.{layer_idx}.down_proj")

    def forward(self, x):
        gu = self.gate_up_proj(x)
        if gu.is_cuda and gu.dim() == 2 and _fused().ENABLED:  # one kernel on the strided halves
            return self.down_proj(_fused().silu_mul(gu))
        gate, up = gu.split(self.inter, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg, layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, cos_sin, x, ctx):
        x = x + self.self_attn(cos_sin, self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        if cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            self.lm_head.weight = self.embed_tokens.weight
        else:
            self.lm_head = make_linear(cfg.hidden_size, cfg.vocab_size, False, "lm_head")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """Returns final hidden states [T, hidden] (call compute_logits on the rows you need)."""
        x = self.embed_tokens(input_ids)
        cos_sin = self.rope.lookup(positions)
        for layer in self.layers:
            x = layer(cos_sin, x, ctx)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # ---- weight loading: HF tensor names -> our fused parameters ----
    _FUSED = {  # hf suffix -> (our module suffix, shard index)
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", 1),
        "self_attn.v_proj": ("self_attn.qkv_proj", 2),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", 1),
    }

    def _shard_range(self, module_suffix: str, idx: int) -> tuple[int, int]:
        c = self.config
        if module_suffix.endswith("qkv_proj"):
            q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
            return [(0, q), (q, q + kv), (q + kv, q + 2 * kv)][idx]
        i = c.intermediate_size
        return [(0, i), (i, 2 * i)][idx]

    def load_weights(self, weights) -> None:
        """weights: iterable of (hf_name, tensor) using HF Llama names (model.layers.N.self_attn.q_proj.weight, ...).
        Raises ValueError for a missing or mis-shaped tensor, so a bad checkpoint never runs silently."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, w in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, rows = name, None
            for hf, (ours, idx) in self._FUSED.items():
                if f".{hf}." in name:
                    target = name.replace(hf, ours)
                    rows = self._shard_range(ours, idx)
                    break
            p = params.get(target)
            if p is None:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            dst = p.data if rows is None else p.data[rows[0]:rows[1]]
            if tuple(dst.shape) != tuple(w.shape):
                raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(w.shape)} vs model {tuple(dst.shape)}")
            dst.copy_(w)
            loaded.add(target if rows is None else f"{target}#{rows[0]}")
        expected = set()
        for n in params:
            if n == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            mod = n.rsplit(".", 1)[0]
            if mod.endswith("qkv_proj") or mod.endswith("gate_up_proj"):
                k = 3 if mod.endswith("qkv_proj") else 2
                expected |= {f"{n}#{self._shard_range(mod, i)[0]}" for i in range(k)}
            else:
                expected.add(n)
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {sorted(missing)[:3]}")
