"""Quantize-on-load: swap a model's nn.Linear layers for kestrel QuantLinear (RTN), `--quantization SCHEME`.

The lm_head stays in the model dtype (as in vLLM/GPTQ practice: it is the most quantization-sensitive layer)
and the embedding is a gather, not a GEMM. Layers are converted one at a time on their own device, so the
peak memory is the model plus one layer's float weight.
"""
from __future__ import annotations

import torch
from torch import nn
from tqdm import tqdm

from kestrel.quant.spec import QuantSpec

# scheme name -> QuantSpec (None = leave the model in its float dtype)
QUANTIZATION_SCHEMES: dict[str, QuantSpec | None] = {
    "none": None,
    "int4-g128": QuantSpec(weight_dtype="int4", act_dtype="bf16", group_size=128),  # W4A16, symmetric (GPTQ-sym)
    "int4-g128-zp": QuantSpec(weight_dtype="uint4", act_dtype="bf16", group_size=128, has_zero_point=True),  # AWQ-like
    "int8": QuantSpec(weight_dtype="int8", act_dtype="bf16", group_size=-1),  # W8A16 per channel
    # FP8 weights, bf16 activations (weight-only, like vLLM's FP8 Marlin path): WNA16 kernel
    "fp8": QuantSpec(weight_dtype="fp8_e4m3", act_dtype="bf16", group_size=-1, scale_dtype="fp32"),
    "mxfp4": QuantSpec(weight_dtype="fp4_e2m1", act_dtype="bf16", group_size=32, scale_dtype="e8m0"),
    "nvfp4": QuantSpec(weight_dtype="fp4_e2m1", act_dtype="bf16", group_size=16, scale_dtype="fp8_e4m3",
                       global_scale=True),
}


def quant_spec(scheme: str | None) -> QuantSpec | None:
    """The QuantSpec of a scheme name (None/'none' -> None); ValueError listing the known names otherwise."""
    if scheme is None:
        return None
    key = scheme.lower()
    if key not in QUANTIZATION_SCHEMES:
        raise ValueError(f"unknown --quantization {scheme!r}; known: {', '.join(QUANTIZATION_SCHEMES)}")
    return QUANTIZATION_SCHEMES[key]


def _linears(model: nn.Module, skip: tuple[str, ...]):
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and not any(name == s or name.endswith("." + s) for s in skip):
            yield name, mod


@torch.no_grad()
def quantize_model(model: nn.Module, scheme: str | QuantSpec | None, skip: tuple[str, ...] = ("lm_head",),
                   progress: bool = False) -> nn.Module:
    """Replace every nn.Linear (except `skip`) by QuantLinear.from_float(linear, spec), in place. Returns model."""
    spec = scheme if isinstance(scheme, QuantSpec) else quant_spec(scheme)
    if spec is None:
        return model
    from kestrel.kernels.quant_linear import QuantLinear

    targets = list(_linears(model, skip))
    if not targets:
        raise ValueError("the model has no nn.Linear layers to quantize")
    for name, lin in tqdm(targets, desc=f"Quantizing ({spec.name})", unit="layer", disable=not progress):
        if lin.in_features % max(spec.group_size, 1):
            raise ValueError(f"{name}: in_features={lin.in_features} is not a multiple of group size {spec.group_size}")
        q = QuantLinear.from_float(lin, spec)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, q)
        lin.weight = None  # drop the float weight now: peak memory stays at one layer's float copy
    return model
