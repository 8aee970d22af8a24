"""Helpers for the engine and tensor/expert-parallel tests: tiny random HF checkpoints, recording the engine's
logits, forked gloo ranks on loopback."""
from __future__ import annotations

import io
import multiprocessing as mp
import socket
import traceback

import torch


def free_init_method() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def make_tiny_llama(path: str, seed: int = 0, **overrides) -> None:
    """A random tiny Llama in HF format (config.json + safetensors + the embedded tokenizer; the model's vocabulary
    is the tokenizer's first 1000 ids, enough for token-id prompts and small, fast shards)."""
    import transformers

    kw = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, rms_norm_eps=1e-5,
              bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    kw.update(overrides)
    torch.manual_seed(seed)
    save_tiny(transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval(), path)


def save_tiny(model, path: str) -> None:
    """Perturb a freshly initialised HF model's biases and norm weights (zeros / ones at init would hide bugs in
    them; uses torch's global RNG), then save it with the embedded tokenizer as a loadable checkpoint."""
    from kestrel.model.loader import load_tokenizer, resolve

    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    load_tokenizer(*resolve(None)[:2]).save_pretrained(path)


def record_logits(engine) -> list:
    """Wrap engine.runner.forward_step so every step's logits [rows, vocab] are kept, in order (only the
    synchronous loop calls forward_step: build the engine with async_scheduling=False)."""
    seen, inner = [], engine.runner.forward_step

    def forward_step(batch):
        order, logits = inner(batch)
        if logits is not None:
            seen.append(logits.clone())
        return order, logits
    engine.runner.forward_step = forward_step
    return seen


def _child(fn, rank, world, init_method, args, q):
    torch.set_num_threads(1)  # two ranks share the CI machine's cores
    try:
        buf = io.BytesIO()  # bytes, not tensors: torch's queue pickler would share storage with a dying child
        torch.save(fn(rank, world, init_method, *args), buf)
        q.put((rank, "ok", buf.getvalue()))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world: int, *args, timeout: float = 240.0) -> dict:
    """Run fn(rank, world, init_method, *args) in `world` forked processes; -> {rank: return value}.
    A rank's exception fails the caller with that rank's traceback; a hang fails after `timeout`."""
    ctx = mp.get_context("fork")  # fork: the children reuse the parent's imported torch (spawn costs ~10 s each)
    q = ctx.Queue()
    init_method = free_init_method()
    procs = [ctx.Process(target=_child, args=(fn, r, world, init_method, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, status, val = q.get(timeout=timeout)
            if status == "error":
                errors.append(f"rank {rank}:\n{val}")
                break
            results[rank] = torch.load(io.BytesIO(val), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return results

