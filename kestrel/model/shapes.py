"""Exact shapes of well-known models, for `--load-format dummy --model-shape NAME`: benchmarks and memory planning
need the real layer sizes, not the real weights. Values are the published config.json fields.

`llama-3-70b-tp8` is the share of Llama-3-70B that one GPU holds under 8-way tensor parallelism (heads, KV heads,
MLP width and vocabulary split by 8; hidden size and depth unchanged): one GPU's per-step work in an 8-GPU
deployment, minus the all-reduces.
"""
from __future__ import annotations

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

MODEL_SHAPES: dict[str, dict] = {
    "llama-3-8b": dict(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
                       max_position_embeddings=8192, bos_token_id=128000, eos_token_ids=[128001, 128009]),
    "llama-3-70b": dict(architecture="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
                        max_position_embeddings=8192, bos_token_id=128000, eos_token_ids=[128001, 128009]),
    "llama-3-70b-tp8": dict(architecture="llama", vocab_size=128256 // 8, hidden_size=8192,
                            intermediate_size=28672 // 8, num_hidden_layers=80, num_attention_heads=64 // 8,
                            num_key_value_heads=8 // 8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                            rope_scaling=_LLAMA3_ROPE, max_position_embeddings=8192, bos_token_id=128000,
                            eos_token_ids=[128001, 128009]),
    "mistral-7b": dict(architecture="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=32768,
                       sliding_window=4096, bos_token_id=1, eos_token_ids=[2]),
    # Qwen1.5-MoE-A2.7B: 60 routed experts (top-4) + one shared expert per layer
    "qwen-moe": dict(architecture="qwen2", vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                     num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, head_dim=128,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=8192, qkv_bias=True,
                     bos_token_id=151643, eos_token_ids=[151643],
                     moe=dict(num_experts=60, top_k=4, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                              norm_topk_prob=False)),
}


def model_shape(name: str) -> dict:
    """ModelConfig keyword arguments for a known shape; ValueError listing the known names otherwise."""
    key = name.lower().replace("_", "-")
    if key not in MODEL_SHAPES:
        raise ValueError(f"unknown --model-shape {name!r}; known: {', '.join(sorted(MODEL_SHAPES))}")
    shape = dict(MODEL_SHAPES[key])
    shape["eos_token_ids"] = list(shape.get("eos_token_ids", []))
    return shape
