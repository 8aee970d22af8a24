"""Model families and checkpoint loaders."""
from .config import ModelConfig
from .layers import make_linear, set_linear_factory
from .llama import LlamaForCausalLM
from .loader import EMBEDDED_MODEL_NAME, LoadedModel, load_model

__all__ = ["ModelConfig", "LlamaForCausalLM", "LoadedModel", "load_model", "make_linear", "set_linear_factory",
           "EMBEDDED_MODEL_NAME"]
