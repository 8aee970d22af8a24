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

# minifloat element formats: name -> (exponent bits, mantissa bits)
MINIFLOATS = {"fp4_e2m1": (2, 1), "fp6_e3m2": (3, 2), "fp6_e2m3": (2, 3), "fp8_e4m3": (4, 3), "fp8_e5m2": (5, 2)}
WEIGHT_DTYPES = tuple(f"int{b}" for b in range(2, 9)) + tuple(f"uint{b}" for b in range(1, 9)) + tuple(MINIFLOATS)
ACT_DTYPES = ("bf16", "fp16", "fp8_e4m3", "int8", "fp4_e2m1")
SCALE_DTYPES = ("fp16", "bf16", "fp32", "e8m0", "fp8_e4m3")


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

    def __post_init__(self):
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"unknown weight_dtype {self.weight_dtype!r}; expected one of {WEIGHT_DTYPES}")
        if self.act_dtype not in ACT_DTYPES:
            raise ValueError(f"unknown act_dtype {self.act_dtype!r}; expected one of {ACT_DTYPES}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"unknown scale_dtype {self.scale_dtype!r}; expected one of {SCALE_DTYPES}")
        if self.group_size != -1 and (self.group_size < 16 or self.group_size & (self.group_size - 1)):
            raise ValueError(f"group_size must be -1 (per channel) or a power of two >= 16, got {self.group_size}")
        if self.has_zero_point and not self.is_int:
            raise ValueError("zero points are only defined for integer weight types")

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
    def is_int(self) -> bool:
        return self.weight_dtype not in MINIFLOATS

    @property
    def minifloat(self) -> tuple[int, int] | None:
        """(exponent bits, mantissa bits) of a float weight type, else None."""
        return MINIFLOATS.get(self.weight_dtype)

    @property
    def container_bits(self) -> int:
        """Bits each code occupies in the packed int32 words: 3 -> 4, 5..7 -> 8 (a word holds whole codes)."""
        b = self.weight_bits
        return b if b in (1, 2, 4, 8) else (4 if b == 3 else 8)

    @property
    def elems_per_word(self) -> int:
        return 32 // self.container_bits

    @property
    def k_multiple(self) -> int:
        """K granularity of the packed layout (packing.py); other K are stored zero-padded up to a multiple."""
        from kestrel.quant.packing import plane_block
        return plane_block(self.container_bits)

    @property
    def code_offset(self) -> int:
        """Stored codes are unsigned; a symmetric value v is stored as v + 2^(b-1) (offset binary). That holds for
        int{b} and for uint{b} without zero points (GPTQ's symmetric "zero = 8" convention)."""
        if not self.is_int or self.has_zero_point:
            return 0
        return 1 << (self.weight_bits - 1)

    @property
    def name(self) -> str:
        g = "pc" if self.group_size == -1 else f"g{self.group_size}"
        z = "z" if self.has_zero_point else "s"
        return f"w{self.weight_dtype}-a{self.act_dtype}-{g}-{z}-{self.scale_dtype}" + ("-actorder" if self.act_order else "") + (
            "-gs" if self.global_scale else "")
