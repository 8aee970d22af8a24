"""Unified quantization formats: QuantSpec, the internal packed QuantizedWeight, reference dequantize,
RTN quantize, and converters from checkpoint layouts (GPTQ, AWQ, compressed-tensors, FP8, MXFP4, NVFP4, GGUF)."""
from kestrel.quant.converters import (from_awq, from_compressed_tensors, from_fp8, from_gguf, from_gptq, from_mxfp4,
                                      from_nvfp4)
from kestrel.quant.rtn import quantize
from kestrel.quant.spec import QuantSpec
from kestrel.quant.weight import QuantizedWeight, dequantize

__all__ = ["QuantSpec", "QuantizedWeight", "dequantize", "quantize", "from_awq", "from_compressed_tensors",
           "from_fp8", "from_gguf", "from_gptq", "from_mxfp4", "from_nvfp4"]
