"""Quantize-on-load swaps every nn.Linear but the lm_head for QuantLinear, and the model then computes what a
dequantize-then-matmul copy of the original model computes (kestrel.quant reference RTN + dequantize)."""
import copy

import pytest
import torch

from kestrel.kernels.quant_linear import QuantLinear
from kestrel.model.dummy import build_dummy_model, dummy_config
from kestrel.model.quantize import QUANTIZATION_SCHEMES, quant_spec, quantize_model
from kestrel.quant.rtn import quantize
from kestrel.quant.weight import dequantize


class _Causal:
    def attention(self, layer, q, k, v):
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                             is_causal=True, enable_gqa=True)
        return o.transpose(0, 1).reshape(q.shape[0], -1)


def _tiny(seed=0):
    cfg, _ = dummy_config(dict(vocab_size=80, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64))
    return build_dummy_model(cfg, torch.float32, "cpu", seed=seed)


@pytest.mark.parametrize("scheme", ["int4-g128", "int4-g128-zp", "int8", "fp8"])
def test_quantized_model_matches_dequantized_reference(scheme):
    model = _tiny()
    spec = quant_spec(scheme)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, mod in ref.named_modules():
            if isinstance(mod, torch.nn.Linear) and name != "lm_head":
                mod.weight.copy_(dequantize(quantize(mod.weight, spec)).to(mod.weight.dtype))
    quantize_model(model, scheme)
    swapped = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    assert len(swapped) == 2 * 4  # qkv, o, gate_up, down per layer
    assert isinstance(model.lm_head, torch.nn.Linear) and not isinstance(model.lm_head, QuantLinear)
    ids, pos = torch.randint(0, 80, (9,)), torch.arange(9)
    with torch.no_grad():
        out = model.compute_logits(model(ids, pos, _Causal()))
        exp = ref.compute_logits(ref(ids, pos, _Causal()))
        orig = _tiny().compute_logits(_tiny()(ids, pos, _Causal()))
    assert ((out - exp).norm() / exp.norm()).item() < 1e-5
    assert not torch.allclose(out, orig)  # quantization really changed the weights


def test_quantize_none_is_identity_and_bad_scheme_is_clear():
    model = _tiny()
    assert quantize_model(model, "none") is model
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    with pytest.raises(ValueError, match="known: none, int4-g128"):
        quant_spec("int5-g7")
    assert set(QUANTIZATION_SCHEMES) >= {"none", "int4-g128", "fp8"}
