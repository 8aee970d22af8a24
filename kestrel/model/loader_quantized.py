"""Build a Llama-family model straight from a pre-quantized HF checkpoint (quant_config.py reads the format): every
quantized linear becomes a QuantLinear made from the checkpoint's packed tensors; layers the checkpoint keeps in
float (lm_head, tied embeddings, ignore lists) stay nn.Linear in the model dtype. Quantized scales keep their stored
dtype (a fp16 GPTQ scale is not rounded to bf16).

Fused projections (q|k|v, gate|up) are concatenated along N in the packed domain: our layout packs along K, so the
parts' qweight/scales/zeros columns simply sit side by side and dequantize to exactly the stacked weights. The model
then keeps one GEMM per projection, which is what the fused decoder, CUDA graphs and tensor-parallel sharding
expect, and a decode step streams the weights in 4 kernels a layer instead of 7. That needs one QuantSpec and, with
act-order, one input permutation for all parts: GPTQ gives q/k/v (and gate/up) the same g_idx in practice, since
they see the same inputs (same Hessian); llm-compressor gives them one NVFP4 global scale. Parts that differ anyway
(other g_idx or global scales, some parts in float) run as separate GEMMs in a ConcatLinear, still exact.
"""
from __future__ import annotations

import glob
import os
from dataclasses import replace

import torch
from torch import nn
from tqdm import tqdm

from kestrel.quant.weight import QuantizedWeight

from .config import ModelConfig
from .llama import LlamaForCausalLM
from .quant_config import IGNORED_SUFFIXES, CheckpointQuant


class ConcatLinear(nn.Module):
    """A fused projection whose parts cannot share one packed weight: one GEMM per part, outputs concatenated."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


class _Tensors:
    """Lazy access to every tensor of the directory's *.safetensors files; remembers which were read."""

    def __init__(self, path: str):
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ValueError(f"no *.safetensors files in {path}")
        self.handles = [safe_open(f, framework="pt") for f in files]
        self.where = {k: h for h in self.handles for k in h.keys()}  # noqa: SIM118 (safe_open is not a dict)
        self.used: set[str] = set()

    def get(self, name: str) -> torch.Tensor | None:
        h = self.where.get(name)
        if h is None:
            return None
        self.used.add(name)
        return h.get_tensor(name)


def _linear_targets(cfg: ModelConfig) -> list[tuple[str, list[str], list[tuple[int, int]]]]:
    """(our module, its HF parts, each part's expected (out, in)) for every linear the checkpoint provides."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    inter = cfg.intermediate_size
    out = []
    for i in range(cfg.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out += [(f"layers.{i}.self_attn.qkv_proj", [a + "q_proj", a + "k_proj", a + "v_proj"],
                 [(q, h), (kv, h), (kv, h)]),
                (f"layers.{i}.self_attn.o_proj", [a + "o_proj"], [(h, q)]),
                (f"layers.{i}.mlp.gate_up_proj", [m + "gate_proj", m + "up_proj"], [(inter, h), (inter, h)]),
                (f"layers.{i}.mlp.down_proj", [m + "down_proj"], [(h, inter)])]
    if not cfg.tie_word_embeddings:
        out.append(("lm_head", ["lm_head"], [(cfg.vocab_size, h)]))
    return out


def concat_quantized(qws: list[QuantizedWeight]) -> QuantizedWeight | None:
    """Stack weights along N in the packed domain; None when they do not share one spec/permutation."""
    if len(qws) == 1:
        return qws[0]
    if any(q.zeros is not None for q in qws):  # symmetric parts get explicit zeros (= their code offset)
        qws = [q if q.zeros is not None or not q.spec.is_int else replace(
            q, spec=replace(q.spec, weight_dtype=f"uint{q.spec.weight_bits}", has_zero_point=True),
            zeros=torch.full_like(q.scales, q.spec.code_offset)) for q in qws]
    same = lambda a, b: (a is None) == (b is None) and (a is None or torch.equal(a, b))
    q0 = qws[0]
    for q in qws[1:]:  # NVFP4: llm-compressor gives fused parts one global scale for exactly this reason
        if (q.spec, q.shape[1], q.scales.dtype) != (q0.spec, q0.shape[1], q0.scales.dtype) or not (
                same(q.perm, q0.perm) and same(q.global_scale, q0.global_scale)):
            return None
    cat = lambda name: None if getattr(q0, name) is None else torch.cat([getattr(q, name) for q in qws], dim=1)
    return QuantizedWeight(spec=q0.spec, shape=(sum(q.shape[0] for q in qws), q0.shape[1]), qweight=cat("qweight"),
                           scales=cat("scales"), zeros=cat("zeros"), perm=q0.perm, global_scale=q0.global_scale)


def _float_linear(w: torch.Tensor, bias: torch.Tensor | None, dtype, device) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device=device, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


def _build_linear(parts: list, biases: list, dtype, device) -> nn.Module:
    """parts: QuantizedWeight or float weight per HF part (checked shapes); biases: tensor or None per part."""
    from kestrel.kernels.quant_linear import QuantLinear

    bias = None if biases[0] is None else torch.cat(biases).to(dtype)
    if all(isinstance(p, torch.Tensor) for p in parts):
        return _float_linear(torch.cat(parts), bias, dtype, device)
    if all(isinstance(p, QuantizedWeight) for p in parts):
        qw = concat_quantized(parts)
        if qw is not None:
            return QuantLinear(qw, bias).to(device)
    mods = [QuantLinear(p, b if b is None else b.to(dtype)).to(device) if isinstance(p, QuantizedWeight)
            else _float_linear(p, b, dtype, device) for p, b in zip(parts, biases)]
    return ConcatLinear(mods)


def load_prequantized(cfg: ModelConfig, path: str, quant: CheckpointQuant, dtype: torch.dtype, device: str,
                      progress: bool, finish) -> LlamaForCausalLM:
    """`finish(model)` casts/moves the float part (loader._finish); the quantized linears are put in afterwards, so
    their packed tensors and scales keep the checkpoint's dtypes."""
    st = _Tensors(path)
    with torch.device("meta"):
        m = LlamaForCausalLM(cfg)
    targets = _linear_targets(cfg)
    for ours, _, _ in targets:  # no float copy of any linear is ever allocated
        parent, _, attr = ours.rpartition(".")
        setattr(m.get_submodule(parent) if parent else m, attr, nn.Identity())
    m = m.to_empty(device="cpu")
    if cfg.tie_word_embeddings:
        m.lm_head.weight = m.embed_tokens.weight
    # float tensors: embeddings, norms (and the tied lm_head's weight is the embedding)
    prefixes = tuple(p + "." for _, parts, _ in targets for p in parts)
    params, loaded = dict(m.named_parameters()), set()
    for name in st.where:
        if name.startswith(prefixes) or "rotary_emb" in name or name.endswith(IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        p = params.get(name.removeprefix("model."))
        if p is None:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        w = st.get(name)
        if tuple(p.shape) != tuple(w.shape):
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(w.shape)} vs model {tuple(p.shape)}")
        p.data.copy_(w)
        loaded.add(name.removeprefix("model."))
    missing = {n for n in params if n != "lm_head.weight"} - loaded
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {sorted(missing)[:3]}")
    m = finish(m)
    want_bias = {"qkv_proj": cfg.qkv_bias, "o_proj": cfg.o_bias, "gate_up_proj": cfg.mlp_bias,
                 "down_proj": cfg.mlp_bias, "lm_head": False}
    for ours, hf_parts, shapes in tqdm(targets, desc=f"Loading {quant.method} linears", unit="layer",
                                       disable=not progress):
        parts, biases = [], []
        for hf, shape in zip(hf_parts, shapes):
            qw = quant.convert(hf, st.get)
            w = qw if qw is not None else st.get(hf + ".weight")
            if w is None:
                raise ValueError(f"checkpoint has neither quantized tensors nor a weight for {hf!r}")
            got = tuple(w.shape)
            if got != shape:
                raise ValueError(f"shape mismatch for {hf}: checkpoint {got} vs model {shape}")
            if isinstance(w, torch.Tensor) and not w.is_floating_point():
                raise ValueError(f"{hf}.weight has dtype {w.dtype} but {quant.describe()} does not describe it")
            b = st.get(hf + ".bias")
            expect = want_bias[ours.rsplit(".", 1)[-1]]
            if b is not None and not expect and not bool(b.any()):
                b = None  # some GPTQ exports store zero biases for bias-free layers
            if (b is not None) != expect:
                raise ValueError(f"{hf}: bias {'unexpected' if b is not None else 'missing'} for this model config")
            parts.append(w)
            biases.append(b)
        mod = _build_linear(parts, biases, dtype, device)
        parent, _, attr = ours.rpartition(".")
        setattr(m.get_submodule(parent) if parent else m, attr, mod)
    unused = [n for n in st.where if n not in st.used and n.startswith(prefixes) and not n.endswith(IGNORED_SUFFIXES)]
    if unused:
        raise ValueError(f"checkpoint has {len(unused)} tensors the {quant.method} loader did not use, "
                         f"e.g. {unused[:3]}")
    return m.eval().requires_grad_(False)
