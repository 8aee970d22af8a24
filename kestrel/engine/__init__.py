"""Paged continuous-batching engine: block manager, scheduler, model runner, sampler."""
from .config import EngineConfig
from .outputs import RequestOutput
from .sampling_params import SamplingParams


def __getattr__(name):  # LLMEngine pulls in torch models and transformers: import it lazily
    if name == "LLMEngine":
        from .llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)


__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
