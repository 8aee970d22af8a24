"""Turn a loaded (unsharded) Llama-family model into this rank's tensor-parallel shard, in place.

Attention heads are split across ranks (q heads evenly; KV heads evenly, or replicated when there are fewer KV
heads than ranks, as in vLLM), qkv/gate_up become column-parallel, o/down row-parallel (one all-reduce each per
layer), embedding and LM head vocab-parallel. Every rank loads the same full checkpoint and keeps its slices, so
TP=N starts from exactly the weights TP=1 runs. Returns the per-rank ModelConfig (heads per rank) that sizes the
rank's KV cache and attention backend.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from kestrel.model.config import ModelConfig

from .distributed import ParallelGroup
from .linear import ColumnParallelLinear, RowParallelLinear
from .moe import ParallelQwenMoeBlock, is_moe_block
from .vocab import ParallelLMHead, VocabParallelEmbedding


def heads_per_rank(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    """-> (q heads, kv heads) on each rank; ValueError when the model cannot be split `tp` ways."""
    h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if tp < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {tp}")
    if h % tp:
        raise ValueError(f"{h} attention heads cannot be split over tensor parallel size {tp}")
    if kv % tp and tp % kv:
        raise ValueError(f"{kv} KV heads cannot be split or replicated over tensor parallel size {tp}")
    if cfg.intermediate_size % tp:
        raise ValueError(f"intermediate size {cfg.intermediate_size} is not divisible by tensor parallel size {tp}")
    return h // tp, max(1, kv // tp)


def check_tp_size(cfg: ModelConfig, tp: int) -> None:
    heads_per_rank(cfg, tp)


@torch.no_grad()
def shard_llama(model: nn.Module, group: ParallelGroup) -> ModelConfig:
    cfg: ModelConfig = model.config
    tp, r = group.size, group.rank
    hq, hkv = heads_per_rank(cfg, tp)
    d = cfg.head_dim
    q_size, kv_size = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    kv_head0 = r * hkv if cfg.num_key_value_heads >= tp else r * cfg.num_key_value_heads // tp
    qkv_rows = [(r * hq * d, (r + 1) * hq * d),
                (q_size + kv_head0 * d, q_size + (kv_head0 + hkv) * d),
                (q_size + kv_size + kv_head0 * d, q_size + kv_size + (kv_head0 + hkv) * d)]
    inter = cfg.intermediate_size
    for layer in model.layers:
        attn = layer.self_attn
        attn.qkv_proj = ColumnParallelLinear.from_full(attn.qkv_proj, group, rank_segments=qkv_rows)
        attn.o_proj = RowParallelLinear.from_full(attn.o_proj, group)
        attn.num_heads, attn.num_kv_heads = hq, hkv
        attn.q_size, attn.kv_size = hq * d, hkv * d
        mlp = layer.mlp
        if is_moe_block(mlp):  # MoE: experts split by expert (each rank computes its experts for all tokens)
            layer.mlp = ParallelQwenMoeBlock(mlp, group, tokens="replicated")
        elif hasattr(mlp, "gate_up_proj"):
            mlp.gate_up_proj = ColumnParallelLinear.from_full(mlp.gate_up_proj, group, segment_sizes=[inter, inter])
            mlp.down_proj = RowParallelLinear.from_full(mlp.down_proj, group)
            mlp.inter = inter // tp
        else:
            raise ValueError(f"tensor parallelism does not know how to split {type(mlp).__name__}")
    emb = VocabParallelEmbedding.from_full(model.embed_tokens, group)
    head = ParallelLMHead.from_full(model.lm_head, cfg.vocab_size, group,
                                    tied=emb if cfg.tie_word_embeddings else None)
    model.embed_tokens, model.lm_head = emb, head
    return replace(cfg, num_attention_heads=hq, num_key_value_heads=hkv, eos_token_ids=list(cfg.eos_token_ids))
