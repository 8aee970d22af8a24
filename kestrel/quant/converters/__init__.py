"""Converters from real checkpoint layouts into the one internal QuantizedWeight layout."""
from kestrel.quant.converters.awq import from_awq
from kestrel.quant.converters.compressed_tensors import from_compressed_tensors
from kestrel.quant.converters.fp8 import from_fp8
from kestrel.quant.converters.gguf_blocks import from_gguf
from kestrel.quant.converters.gptq import from_gptq
from kestrel.quant.converters.microscaling import from_mxfp4, from_nvfp4

__all__ = ["from_awq", "from_compressed_tensors", "from_fp8", "from_gguf", "from_gptq", "from_mxfp4", "from_nvfp4"]
