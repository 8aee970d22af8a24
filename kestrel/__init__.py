"""kestrel: an LLM inference stack. The data path reads top-down through the subpackages:
server -> engine (scheduler, runner, sampler) -> model -> kernels -> quant; spec and router sit beside/above."""
__version__ = "0.1.0"
