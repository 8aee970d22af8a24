"""GGUF checkpoints (llama.cpp format): metadata -> ModelConfig, tensors -> HF-named float tensors.

Quantized tensors (Q4_1, Q8_0, ...) are dequantized with `gguf.quants.dequantize`. llama.cpp's converter
permutes the rows of q/k weights for its interleaved RoPE; we undo that so the HF rotate-half RoPE applies
(same inverse permutation as transformers' GGUF loader)."""
from __future__ import annotations

import numpy as np
import torch
from tqdm import tqdm

from .config import ModelConfig

# GGUF tensor name part -> HF name part
_NAME_MAP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def read_metadata(reader) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        if key in ("tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # unusual field types are not needed for the model
            pass
    return meta


def hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        layer, base, kind = parts[1], parts[2], parts[3]
        return f"model.layers.{layer}.{_NAME_MAP[base]}.{kind}"
    base, kind = parts[0], parts[1]
    if base not in _NAME_MAP:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{_NAME_MAP[base]}.{kind}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # inverse of llama.cpp convert_hf_to_gguf `permute`: rows are (head, half, dim/2) there, (head, dim/2, half) here
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def load_gguf(path: str, progress: bool = True):
    """Returns (ModelConfig, dict hf_name -> float32 tensor, metadata)."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:
        raise ValueError(f"cannot read GGUF file {path}: {e}") from e
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    cfg = ModelConfig.from_gguf_fields(meta, has_output_tensor="output.weight" in names,
                                       has_qkv_bias="blk.0.attn_q.bias" in names)
    tensors = {}
    for t in tqdm(reader.tensors, desc="Loading GGUF", unit="tensor", disable=not progress):
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists dims fastest-first
        arr = np.asarray(arr, dtype=np.float32).reshape(shape)
        name = hf_name(t.name)
        if cfg.architecture == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            arr = _unpermute(arr, heads)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(arr))
    return cfg, tensors, meta
