"""Pre-quantized HF checkpoints: read config.json's `quantization_config` and turn one linear layer's stored tensors
into kestrel's QuantizedWeight through kestrel.quant.converters (packed codes stay packed: no float round trip).

Supported (anything else is a ValueError naming what is): GPTQ (AutoGPTQ / GPTQModel, v1 and v2 zero storage,
act-order g_idx, GPTQModel `dynamic` per-module overrides), AWQ (AutoAWQ GEMM), compressed-tensors (llm-compressor:
pack-quantized int, float-quantized FP8, nvfp4-pack-quantized, naive/int-quantized int8) and FP8 (AutoFP8 / vLLM
`quant_method: fp8`, per-tensor or per-channel scale). A layer the checkpoint keeps in float (lm_head, ignore lists)
has no quantized tensors: convert() returns None for it and the loader reads its `.weight`.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import replace

import torch

from kestrel.quant.converters import (
    from_awq,
    from_compressed_tensors,
    from_fp8,
    from_gptq,
    from_nvfp4,
)
from kestrel.quant.packing import pack_codes, unpack_codes
from kestrel.quant.spec import QuantSpec
from kestrel.quant.weight import QuantizedWeight

SUPPORTED = ("gptq (2/3/4/8-bit, checkpoint_format gptq or gptq_v2), awq (4-bit, version gemm), compressed-tensors "
             "(pack-quantized int 2/4/8-bit, float-quantized FP8 per tensor/channel, nvfp4-pack-quantized, "
             "int-quantized int8), fp8 (per-tensor or per-channel weight_scale)")
# checkpoint tensors the weight-only path does not use: activation / KV-cache scales of W8A8 and FP8-KV checkpoints
IGNORED_SUFFIXES = (".input_scale", ".output_scale", ".k_scale", ".v_scale", ".input_global_scale")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

Getter = Callable[[str], "torch.Tensor | None"]


def read_quantization_config(path: str) -> dict | None:
    """config.json's quantization_config, else an old AutoGPTQ quantize_config.json (GPTQ), else None."""
    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f).get("quantization_config")
    if qc is None and os.path.exists(os.path.join(path, "quantize_config.json")):
        with open(os.path.join(path, "quantize_config.json")) as f:
            qc = {"quant_method": "gptq", **json.load(f)}
    return qc


def checkpoint_quant(qc: dict) -> CheckpointQuant:
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    cls = {"gptq": GPTQ, "awq": AWQ, "compressed-tensors": CompressedTensors, "fp8": FP8}.get(method)
    if cls is None:
        raise ValueError(f"pre-quantized checkpoint with quant_method={qc.get('quant_method')!r} is not supported; "
                         f"supported: {SUPPORTED}")
    return cls(qc)


def _need(get: Getter, name: str) -> torch.Tensor:
    t = get(name)
    if t is None:
        raise ValueError(f"checkpoint is missing {name!r}")
    return t


def _rtn_name(spec: QuantSpec) -> str | None:
    """The --quantization scheme that produces this format (so `--quantization int4-g128` on a GPTQ 4-bit g128 sym
    checkpoint is accepted as 'what is already there')."""
    from .quantize import QUANTIZATION_SCHEMES

    for name, s in QUANTIZATION_SCHEMES.items():
        if s is not None and (s.weight_bits, s.is_int, s.group_size, s.has_zero_point) == (
                spec.weight_bits, spec.is_int, spec.group_size, spec.has_zero_point):
            return name
    return None


def apply_g_idx(qw: QuantizedWeight, g_idx: torch.Tensor | None) -> QuantizedWeight:
    """Act-order for converters that ignore g_idx (compressed-tensors): sort the packed K rows by group, as from_gptq
    does, so every group is contiguous and the kernel gathers x[:, perm]."""
    if g_idx is None:
        return qw
    k, gs, cb = qw.shape[1], qw.group_size, qw.spec.container_bits
    g = g_idx.cpu().to(torch.int64)
    trivial = torch.arange(k) // gs
    if torch.equal(g, trivial):
        return qw
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], trivial):
        raise ValueError("g_idx groups must each hold exactly group_size channels")
    codes = unpack_codes(qw.qweight, cb, k)[:, perm]
    return replace(qw, spec=replace(qw.spec, act_order=True), qweight=pack_codes(codes, cb), perm=perm)


class CheckpointQuant:
    method = ""

    def __init__(self, qc: dict):
        self.qc = qc

    def describe(self) -> str:
        return self.method

    def rtn_equivalent(self) -> str | None:
        return None

    def check_requested(self, requested: str | None) -> None:
        """--quantization on a pre-quantized checkpoint must name what is there (the method or the same scheme)."""
        if requested is None:
            return
        ok = {self.method, self.rtn_equivalent()} - {None}
        if requested.lower().replace("_", "-") not in ok:
            raise ValueError(f"--quantization {requested} does not match the checkpoint, which is pre-quantized "
                             f"({self.describe()}) and is loaded as stored; drop --quantization or pass "
                             f"{' or '.join(sorted(ok))}")

    def convert(self, name: str, get: Getter) -> QuantizedWeight | None:
        """Module `name` (HF, e.g. model.layers.0.self_attn.q_proj) -> QuantizedWeight, None if stored in float."""
        raise NotImplementedError


class GPTQ(CheckpointQuant):
    method = "gptq"

    def __init__(self, qc: dict):
        super().__init__(qc)
        self.fmt = str(qc.get("checkpoint_format") or "gptq").lower()
        if self.fmt not in ("gptq", "gptq-v2", "gptq_v2") or qc.get("is_marlin_format"):
            raise ValueError(f"GPTQ checkpoint_format {qc.get('checkpoint_format')!r} (or marlin) is not supported; "
                             f"supported: gptq, gptq_v2")
        self.fmt = "gptq_v2" if self.fmt != "gptq" else "gptq"
        self.dynamic = qc.get("dynamic") or {}  # GPTQModel: {"-:regex": {}} skips, {"+:regex": {...}} overrides
        self._args("")

    def _args(self, name: str) -> dict:
        a = dict(bits=self.qc.get("bits", 4), group_size=self.qc.get("group_size", 128), sym=self.qc.get("sym", True))
        for pat, over in self.dynamic.items():
            if not pat.startswith("-:") and re.match(pat.removeprefix("+:"), name):
                a.update({k: v for k, v in over.items() if k in a})
                break
        if a["bits"] not in (2, 3, 4, 8):
            raise ValueError(f"GPTQ bits={a['bits']} is not supported; supported: 2, 3, 4, 8")
        gs = a["group_size"]
        if gs != -1 and (gs < 16 or gs & (gs - 1)):
            raise ValueError(f"GPTQ group_size={gs} is not supported; supported: -1 or a power of two >= 16")
        return a

    def describe(self) -> str:
        a = self._args("")
        return (f"gptq {a['bits']}-bit, group {a['group_size']}, {'sym' if a['sym'] else 'asym'}"
                + (", desc_act" if self.qc.get("desc_act") else ""))

    def rtn_equivalent(self) -> str | None:
        a = self._args("")
        return _rtn_name(QuantSpec(weight_dtype=f"uint{a['bits']}", group_size=a["group_size"],
                                   has_zero_point=not a["sym"]))

    def convert(self, name, get):
        qweight = get(name + ".qweight")
        if qweight is None:
            return None
        a = self._args(name.removeprefix("model."))
        return from_gptq(qweight, _need(get, name + ".qzeros"), _need(get, name + ".scales"), bits=a["bits"],
                         group_size=a["group_size"], g_idx=get(name + ".g_idx"), sym=a["sym"],
                         checkpoint_format=self.fmt)


class AWQ(CheckpointQuant):
    method = "awq"

    def __init__(self, qc: dict):
        super().__init__(qc)
        self.bits = qc.get("bits", qc.get("w_bit", 4))
        self.group_size = qc.get("group_size", qc.get("q_group_size", 128))
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm" or self.bits != 4 or not qc.get("zero_point", True):
            raise ValueError(f"AWQ version={version!r} bits={self.bits} zero_point={qc.get('zero_point', True)} is "
                             f"not supported; supported: version gemm, 4-bit, zero_point true (AutoAWQ's default)")

    def describe(self) -> str:
        return f"awq 4-bit, group {self.group_size}, zero point"

    def rtn_equivalent(self) -> str | None:
        return _rtn_name(QuantSpec(weight_dtype="uint4", group_size=self.group_size, has_zero_point=True))

    def convert(self, name, get):
        qweight = get(name + ".qweight")
        if qweight is None:
            return None
        return from_awq(qweight, _need(get, name + ".qzeros"), _need(get, name + ".scales"),
                        group_size=self.group_size, bits=self.bits)


class FP8(CheckpointQuant):
    method = "fp8"

    def __init__(self, qc: dict):
        super().__init__(qc)
        if qc.get("weight_block_size"):
            raise ValueError(f"block-wise FP8 (weight_block_size={qc['weight_block_size']}) is not supported; "
                             f"supported: fp8 with a per-tensor or per-channel weight_scale")

    def describe(self) -> str:
        return "fp8 e4m3 weights (run as W8A16)"

    def rtn_equivalent(self) -> str | None:
        return "fp8"

    def convert(self, name, get):
        w = get(name + ".weight")
        if w is None or w.dtype not in _FP8:
            return None
        return from_fp8(w, _need(get, name + ".weight_scale"))


class CompressedTensors(CheckpointQuant):
    method = "compressed-tensors"

    def __init__(self, qc: dict):
        super().__init__(qc)
        self.groups = list((qc.get("config_groups") or {}).values())
        if not self.groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        for g in self.groups:
            fmt = g.get("format") or qc.get("format")
            if fmt not in ("pack-quantized", "float-quantized", "nvfp4-pack-quantized", "int-quantized",
                           "naive-quantized", "dense", None):
                raise ValueError(f"compressed-tensors format {fmt!r} is not supported; supported: {SUPPORTED}")
            w = g.get("weights") or {}
            if w.get("strategy") == "block":
                raise ValueError("compressed-tensors block-wise weight scales (strategy 'block') are not supported; "
                                 f"supported: {SUPPORTED}")

    def _group(self, name: str) -> dict:
        """The config group whose targets match module `name` (HF name, class 'Linear' matches every linear)."""
        short = name.removeprefix("model.")
        for g in self.groups:
            for t in g.get("targets", ["Linear"]):
                if t == "Linear" or t in (name, short) or (t.startswith("re:") and re.match(t[3:], name)):
                    return g.get("weights") or {}
        raise ValueError(f"compressed-tensors: no config group targets {name!r}")

    def _spec_hint(self) -> QuantSpec | None:
        w = self.groups[0].get("weights") or {}
        if w.get("type", "int") != "int":
            return QuantSpec(weight_dtype="fp8_e4m3" if w.get("num_bits") == 8 else "fp4_e2m1", group_size=-1)
        gs = w.get("group_size") if w.get("strategy") == "group" else -1
        return QuantSpec(weight_dtype=f"int{w.get('num_bits', 4)}", group_size=gs or -1,
                         has_zero_point=False) if w.get("symmetric", True) else QuantSpec(
            weight_dtype=f"uint{w.get('num_bits', 4)}", group_size=gs or -1, has_zero_point=True)

    def describe(self) -> str:
        w = self.groups[0].get("weights") or {}
        return (f"compressed-tensors {self.qc.get('format')}, {w.get('type', 'int')}{w.get('num_bits')} "
                f"{w.get('strategy')}" + (f" {w.get('group_size')}" if w.get("strategy") == "group" else ""))

    def rtn_equivalent(self) -> str | None:
        w = self.groups[0].get("weights") or {}
        if w.get("type") == "float" and w.get("num_bits") == 4 and w.get("group_size") == 16:
            return "nvfp4"
        return _rtn_name(self._spec_hint())

    def convert(self, name, get):
        packed = get(name + ".weight_packed")
        w = self._group(name) if packed is not None or (get(name + ".weight_scale") is not None) else None
        if w is None:
            return None
        get(name + ".weight_shape")  # informational (K is implied by the packed width)
        if packed is not None and w.get("type") == "float":  # NVFP4: e2m1 pairs, e4m3 block scales, global scale
            return from_nvfp4(packed, _need(get, name + ".weight_scale"), _need(get, name + ".weight_global_scale"))
        if packed is not None:
            gs = w.get("group_size") if w.get("strategy") in ("group", "tensor_group") else None
            qw = from_compressed_tensors(packed, _need(get, name + ".weight_scale"), get(name + ".weight_zero_point"),
                                         num_bits=w.get("num_bits", 4), group_size=gs)
            return apply_g_idx(qw, get(name + ".weight_g_idx"))
        weight, scale = _need(get, name + ".weight"), _need(get, name + ".weight_scale")
        if weight.dtype in _FP8:
            if w.get("strategy") not in ("tensor", "channel", None):
                raise ValueError(f"compressed-tensors FP8 strategy {w.get('strategy')!r} is not supported; "
                                 "supported: tensor, channel")
            return from_fp8(weight, scale)
        if weight.dtype == torch.int8:
            return _int8(weight, scale, get(name + ".weight_zero_point"), w)
        raise ValueError(f"{name}: unexpected quantized weight dtype {weight.dtype}")


def _int8(weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, w: dict) -> QuantizedWeight:
    """int-quantized int8 (W8A8 checkpoints, run as W8A16): signed codes stored as int8, scale [N, 1] or [N, G]."""
    if zero_point is not None and bool(zero_point.ne(0).any()):
        raise ValueError("compressed-tensors int8 with zero points is not supported; supported: symmetric int8")
    n, k = weight.shape
    s = scale.detach().cpu().reshape(n, -1)
    gs = -1 if s.shape[1] == 1 else k // s.shape[1]
    if w.get("strategy") == "tensor" or s.numel() == 1:
        s, gs = s.reshape(1, 1).expand(n, 1), -1
    scale_dtype = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[s.dtype]
    spec = QuantSpec(weight_dtype="int8", group_size=gs, scale_dtype=scale_dtype)
    codes = weight.detach().cpu().to(torch.int32) + spec.code_offset
    return QuantizedWeight(spec=spec, shape=(n, k), qweight=pack_codes(codes, 8), scales=s.t().contiguous())
