"""Random weights of exact shapes, built straight on the target device.

The model is constructed directly on the device in the target dtype (default device + default dtype), then
filled there with a seeded generator: an 8B model takes about a second on a GPU instead of minutes of CPU
init and a host-to-device copy. Used by `--load-format dummy` for benchmarks.
"""
from __future__ import annotations

import torch

from .config import ModelConfig
from .llama import LlamaForCausalLM
from .shapes import model_shape


def dummy_config(shape: str | dict) -> tuple[ModelConfig, dict | None]:
    """-> (ModelConfig, MoE settings or None) for a shape name or a dict of ModelConfig fields."""
    fields = model_shape(shape) if isinstance(shape, str) else dict(shape)
    moe = fields.pop("moe", None)
    return ModelConfig(**fields), moe


@torch.no_grad()
def build_dummy_model(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                      seed: int = 0, moe: dict | None = None, std: float = 0.02) -> torch.nn.Module:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            if moe:
                from .moe import MoeForCausalLM
                model = MoeForCausalLM(cfg, **moe)
            else:
                model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old_dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    lm_head = getattr(model, "lm_head", None)
    for mod in model.modules():
        if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)):
            if mod is lm_head and cfg.tie_word_embeddings:
                continue  # its weight is the embedding's: filled once, as the embedding
            mod.weight.normal_(0.0, std, generator=gen)
            if getattr(mod, "bias", None) is not None:
                mod.bias.zero_()
        elif type(mod).__name__.endswith("Norm"):
            mod.weight.fill_(1.0)
        if hasattr(mod, "reset_dummy"):  # modules with raw parameters (stacked MoE experts) fill themselves
            mod.reset_dummy(gen, std)
        # anything else with parameters (a quantizing linear factory's QuantLinear) was filled when made
    model.rope.build(device, dtype)  # the tables are buffers computed in __init__ on the CPU
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and persistent buffer (quantized packs included), counting tied ones once."""
    seen, total = set(), 0
    for t in list(model.parameters()) + [b for n, b in model.named_buffers() if "rope" not in n]:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
