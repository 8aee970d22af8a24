"""The qwen-moe dummy model: same logits as transformers' Qwen2-MoE given the same random weights (CPU, fp32),
and the named shape has Qwen1.5-MoE-A2.7B's published parameter count."""
import torch

from kestrel.model.dummy import build_dummy_model, dummy_config
from kestrel.model.moe import MoeForCausalLM
from kestrel.model.rope import RotaryEmbedding


class _Causal:
    def attention(self, layer, q, k, v):
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                             is_causal=True, enable_gqa=True)
        return o.transpose(0, 1).reshape(q.shape[0], -1)


def _hf_from_ours(ours, cfg, moe):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    hc = Qwen2MoeConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                        num_key_value_heads=cfg.num_key_value_heads, rms_norm_eps=cfg.rms_norm_eps,
                        rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
                        num_experts=moe["num_experts"], num_experts_per_tok=moe["top_k"],
                        moe_intermediate_size=moe["moe_intermediate_size"],
                        shared_expert_intermediate_size=moe["shared_expert_intermediate_size"],
                        norm_topk_prob=moe["norm_topk_prob"], tie_word_embeddings=False, attn_implementation="eager")
    hf = Qwen2MoeForCausalLM(hc).eval()
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    sd = {"model.embed_tokens.weight": ours.embed_tokens.weight, "model.norm.weight": ours.norm.weight,
          "lm_head.weight": ours.lm_head.weight}
    for i, L in enumerate(ours.layers):
        p = f"model.layers.{i}."
        w, b = L.self_attn.qkv_proj.weight, L.self_attn.qkv_proj.bias
        sd |= {p + "self_attn.q_proj.weight": w[:q], p + "self_attn.k_proj.weight": w[q:q + kv],
               p + "self_attn.v_proj.weight": w[q + kv:], p + "self_attn.q_proj.bias": b[:q],
               p + "self_attn.k_proj.bias": b[q:q + kv], p + "self_attn.v_proj.bias": b[q + kv:],
               p + "self_attn.o_proj.weight": L.self_attn.o_proj.weight,
               p + "input_layernorm.weight": L.input_layernorm.weight,
               p + "post_attention_layernorm.weight": L.post_attention_layernorm.weight,
               p + "mlp.gate.weight": L.mlp.router.weight, p + "mlp.experts.gate_up_proj": L.mlp.w13,
               p + "mlp.experts.down_proj": L.mlp.w2, p + "mlp.shared_expert_gate.weight": L.mlp.shared_expert_gate.weight}
        se = L.mlp.shared_expert
        si = se.inter
        sd |= {p + "mlp.shared_expert.gate_proj.weight": se.gate_up_proj.weight[:si],
               p + "mlp.shared_expert.up_proj.weight": se.gate_up_proj.weight[si:],
               p + "mlp.shared_expert.down_proj.weight": se.down_proj.weight}
    missing, unexpected = hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf


def test_qwen_moe_dummy_matches_transformers():
    shape = dict(architecture="qwen2", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, qkv_bias=True,
                 rope_theta=10000.0, moe=dict(num_experts=6, top_k=2, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=48, norm_topk_prob=False))
    cfg, moe = dummy_config(shape)
    ours = build_dummy_model(cfg, torch.float32, "cpu", seed=4, moe=moe, std=0.1)
    assert isinstance(ours, MoeForCausalLM) and ours.layers[1].mlp.w2.abs().sum() > 0
    with torch.no_grad():
        for L in ours.layers:  # nonzero biases so the qkv-bias mapping is exercised
            L.self_attn.qkv_proj.bias.normal_(0, 0.1)
    hf = _hf_from_ours(ours, cfg, moe)
    ids = torch.randint(0, 97, (13,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = ours.compute_logits(ours(ids, torch.arange(13), _Causal()))
        b = hf(ids[None]).logits[0]
    assert ((a - b).norm() / b.norm()).item() < 1e-4


def test_qwen_moe_shape_param_count(monkeypatch):
    cfg, moe = dummy_config("qwen-moe")
    monkeypatch.setattr(RotaryEmbedding, "build", lambda self, *a, **k: None)
    with torch.device("meta"):
        m = MoeForCausalLM(cfg, **moe)
    # Qwen1.5-MoE-A2.7B: 14.3B parameters (untied embeddings)
    assert sum(p.numel() for p in m.parameters()) == 14_315_784_192
