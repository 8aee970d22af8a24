"""Dummy (shape-exact random) models: the named shapes match transformers' own models parameter for
parameter, and the builder gives a seeded, finite, correctly initialised model on the requested device."""
import pytest
import torch

from kestrel.model import dummy
from kestrel.model.dummy import build_dummy_model, dummy_config, weight_bytes
from kestrel.model.rope import RotaryEmbedding
from kestrel.model.shapes import MODEL_SHAPES, model_shape


def _hf_param_count(shape: dict) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    cls_cfg, cls_model = (MistralConfig, MistralForCausalLM) if shape["architecture"] == "mistral" else \
        (LlamaConfig, LlamaForCausalLM)
    cfg = cls_cfg(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                  intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_hidden_layers"],
                  num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_key_value_heads"],
                  head_dim=shape["head_dim"], tie_word_embeddings=False)
    with torch.device("meta"):
        return sum(p.numel() for p in cls_model(cfg).parameters())


@pytest.mark.parametrize("name,published", [("llama-3-8b", 8_030_261_248), ("llama-3-70b", 70_553_706_496),
                                            ("mistral-7b", 7_248_023_552), ("llama-3-70b-tp8", None)])
def test_shapes_match_transformers_and_published_sizes(name, published, monkeypatch):
    cfg, moe = dummy_config(name)
    assert moe is None
    monkeypatch.setattr(RotaryEmbedding, "build", lambda self, *a, **k: None)  # meta tensors have no values
    with torch.device("meta"):
        ours = sum(p.numel() for p in dummy.LlamaForCausalLM(cfg).parameters())
    assert ours == _hf_param_count(MODEL_SHAPES[name])
    if published is not None:
        assert ours == published


def test_unknown_shape_is_a_clear_error():
    with pytest.raises(ValueError, match="known: .*llama-3-8b"):
        model_shape("llama-9-1t")


def test_tp8_slice_is_one_eighth_of_70b():
    full, part = model_shape("llama-3-70b"), model_shape("llama-3-70b-tp8")
    for k in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        assert part[k] * 8 == full[k]
    assert part["hidden_size"] == full["hidden_size"] and part["num_hidden_layers"] == full["num_hidden_layers"]


class _DenseCausal:
    """A minimal ctx for LlamaForCausalLM: plain causal attention over the tokens of one sequence."""

    def attention(self, layer, q, k, v):
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                             is_causal=True, enable_gqa=True)
        return o.transpose(0, 1).reshape(q.shape[0], -1)


@pytest.mark.parametrize("tie", [True, False])
def test_build_dummy_model_is_seeded_finite_and_initialised(tie):
    shape = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=tie)
    cfg, _ = dummy_config(shape)
    a = build_dummy_model(cfg, torch.float32, "cpu", seed=1)
    b = build_dummy_model(cfg, torch.float32, "cpu", seed=1)
    c = build_dummy_model(cfg, torch.float32, "cpu", seed=2)
    ids = torch.randint(0, 96, (10,))
    pos = torch.arange(10)
    with torch.no_grad():
        la = a.compute_logits(a(ids, pos, _DenseCausal()))
        lb = b.compute_logits(b(ids, pos, _DenseCausal()))
        lc = c.compute_logits(c(ids, pos, _DenseCausal()))
    assert torch.isfinite(la).all() and torch.equal(la, lb) and not torch.allclose(la, lc)
    assert (a.lm_head.weight is a.embed_tokens.weight) == tie
    assert all(torch.equal(m.weight, torch.ones_like(m.weight)) for n, m in a.named_modules() if n.endswith("norm"))
    w = a.layers[1].mlp.down_proj.weight
    assert 0.015 < w.std().item() < 0.025 and abs(w.mean().item()) < 0.01
    n_params = sum(p.numel() for p in a.parameters())  # parameters() yields a tied weight once
    assert weight_bytes(a) == 4 * n_params
    # rotary tables are real, not left uninitialised: position 0 is the identity rotation
    assert torch.allclose(a.rope.cos[0].float(), torch.ones(8)) and torch.allclose(a.rope.sin[0].float(), torch.zeros(8))


def test_build_dummy_model_in_bf16_keeps_dtype_everywhere():
    cfg, _ = dummy_config(dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=32))
    m = build_dummy_model(cfg, torch.bfloat16, "cpu")
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # restored
