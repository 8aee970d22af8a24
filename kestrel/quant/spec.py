"""One description of every quantized weight/activation format kestrel runs.

A checkpoint in any layout (GPTQ, AWQ, compressed-tensors, FP8, MXFP4, NVFP4, GGUF) is converted into a
`QuantizedWeight` carrying a `QuantSpec`; the kernels see only this. Keep the spec hashable: it is part of
the JIT-specialisation and tune-cache keys.
"""
from __future__ import annotations

from dataclasses import dataclass

# weight element types: "int{b}" (signed, b=2..8), "uint{b}" (b=1..8, with or without zero points),
# "fp4_e2m1", "fp6_e3m2", "fp6_e2m3", "fp8_e4m3", "fp8_e5m2"
# activation types: "bf16", "fp16", "fp8_e4m3", "int8", "fp4_e2m1"
# scale types: "fp16", "bf16", "fp32", "e8m0" (MX block scales), "fp8_e4m3" (NVFP4 block scales)


@dataclass(frozen=True)
class QuantSpec:
    weight_dtype: str = "uint4"
    act_dtype: str = "bf16"
    group_size: int = 128  # -1 = per output channel
    has_zero_point: bool = False  # asymmetric (uint + zero) vs symmetric
    scale_dtype: str = "bf16"
    act_order: bool = False  # GPTQ g_idx: the group of input channel k is g_idx[k]
    global_scale: bool = False  # NVFP4 second-level per-tensor scale
    act_group_size: int = -1  # activation quant group (-1 per token); MX/NV use 32/16

    @property
    def weight_bits(self) -> int:
        d = self.weight_dtype
        if d.startswith("fp4"):
            return 4
        if d.startswith("fp6"):
            return 6
        if d.startswith("fp8"):
            return 8
        return int(d.lstrip("uint"))

    @property
    def name(self) -> str:
        g = "pc" if self.group_size == -1 else f"g{self.group_size}"
        z = "z" if self.has_zero_point else "s"
        return f"w{self.weight_dtype}-a{self.act_dtype}-{g}-{z}-{self.scale_dtype}" + ("-actorder" if self.act_order else "")
