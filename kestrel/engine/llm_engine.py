"""LLMEngine: the synchronous engine loop (add_request / step / abort_request), see docs/CONTRACTS.md."""
from __future__ import annotations

import time

import torch

from kestrel.model import load_model

from .async_step import AsyncStepper, wants_async
from .attention import AttentionBackend
from .block_manager import BlockManager
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .model_runner import ModelRunner
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .swa_kv import SwaBlockManager, has_mixed_windows, plan_swa
from .swa_kv import size_pools as size_swa_pools
from .sequence import Sequence, SeqStatus

# Set by kestrel.spec on import (the engine sits below the spec layer and never imports it):
# SPECULATIVE_BUILDER(engine, speculative_config) -> object with .step(engine, batch) and .stats().
SPECULATIVE_BUILDER = None


def size_kv_cache(config: EngineConfig, mc, kv_heads: int | None = None) -> tuple[int, int]:
    """-> (KV blocks, max_model_len): blocks from --num-kv-blocks or --kv-cache-gb (`kv_heads` = this rank's
    share under tensor parallelism), context = what both the model and the cache allow, or the asked-for length."""
    bs = config.block_size
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    else:
        per_block = AttentionBackend.bytes_per_block(mc.num_hidden_layers, bs, kv_heads or mc.num_key_value_heads,
                                                     mc.head_dim, config.torch_dtype)
        num_blocks = max(1, int(config.kv_cache_gb * (1 << 30)) // per_block)
    limit = min(mc.max_position_embeddings, num_blocks * bs)
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds what fits (model context "
                         f"{mc.max_position_embeddings}, KV cache {num_blocks * bs} tokens)")
    return num_blocks, config.max_model_len or limit


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.config = config = config or EngineConfig(**kwargs)
        use_async = wants_async(config, type(self) is LLMEngine)  # validates before the (slow) model load
        torch.manual_seed(config.seed)
        # quantization: RTN on load, or a check that it names a pre-quantized checkpoint's own format
        loaded = load_model(config.model, dtype=config.torch_dtype, device=config.device,
                            load_format=config.load_format, model_shape=config.model_shape, progress=config.progress,
                            quantization=config.quantization)
        self.model = loaded.model
        self.model_config = mc = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name: str = loaded.name
        self.eos_token_ids = set(mc.eos_token_ids)
        bs = config.block_size
        if config.speculative is not None and has_mixed_windows(mc):
            raise ValueError("speculative decoding does not support models with both full and sliding-window layers")
        swa = self.swa_plan = plan_swa(config, mc, type(self) is LLMEngine)  # bounded SWA KV (swa_kv.py) or None
        if swa is not None:
            num_blocks, num_swa_blocks, self.max_model_len = size_swa_pools(config, mc, swa)
            self.block_manager = SwaBlockManager(num_blocks, bs, config.enable_prefix_caching, num_swa_blocks, swa)
        else:
            num_blocks, self.max_model_len = size_kv_cache(config, mc)
            self.block_manager, num_swa_blocks = BlockManager(num_blocks, bs, config.enable_prefix_caching), 0
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len)
        self.runner = ModelRunner(self.model, mc, num_blocks, bs, config.torch_dtype, config.device, config.seed,
                                  swa_plan=swa, num_swa_blocks=num_swa_blocks)
        # subclasses (tensor parallel) replace the runner after this: they capture nothing here
        if config.cuda_graphs and torch.device(config.device).type == "cuda" and type(self) is LLMEngine:
            self.runner.enable_cuda_graphs(config.max_num_seqs, self.max_model_len, config.progress)
        if config.kv_offload_gb > 0:
            from .kv_offload import HostKVTier
            b = self.runner.backend
            per = HostKVTier.bytes_per_block(b.k_cache)
            self.block_manager.offload = HostKVTier(
                b.k_cache, b.v_cache, max(1, int(config.kv_offload_gb * (1 << 30)) // per),
                config.kv_offload_disk_dir, int(config.kv_offload_disk_gb * (1 << 30)) // per)
        self.spec = None
        if config.speculative is not None:
            if SPECULATIVE_BUILDER is None:
                raise ValueError("speculative decoding needs the kestrel.spec package (import kestrel.spec)")
            self.spec = SPECULATIVE_BUILDER(self, config.speculative)
        self.seqs: dict[str, Sequence] = {}
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.num_steps = 0
        self.async_stepper = AsyncStepper(self) if use_async else None

    # ---- requests ----
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.seqs:
            raise ValueError(f"duplicate request id {request_id!r}")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = list(prompt)
            if any((not isinstance(t, int)) or t < 0 or t >= self.model_config.vocab_size for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {self.model_config.vocab_size})")
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but the context is {self.max_model_len} tokens "
                             f"(prompt + at least one generated token must fit)")
        seq = Sequence(request_id, ids, params)
        seq.detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        if not seq.is_finished:
            self.scheduler.finish(seq, "abort")  # frees its KV blocks now
        return True

    def has_unfinished(self) -> bool:
        # async: a sequence in the step in flight is still in the scheduler until that step commits
        return self.scheduler.has_unfinished()

    # ---- the loop ----
    def step(self) -> list[RequestOutput]:
        done = []
        if self.async_stepper is not None:
            if self.spec is None:
                return self.async_stepper.step()
            done = self.drain()  # a speculative decoder was set on a built engine: it steps synchronously
        if self.spec is not None and getattr(self.spec, "loop_active", False):
            outs, looping = self.spec.loop_step(self)  # the overlapped speculative loop owns the batch
            if looping:
                return done + outs
            done = done + outs
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return done
        if self.spec is not None:
            return done + self.spec.step(self, batch)
        return done + self.run_batch(batch)

    def drain(self) -> list[RequestOutput]:
        """Async scheduling: wait for the step in flight and commit it (call before touching KV blocks from
        outside the loop; also ends an overlapped speculative loop). A no-op for the synchronous engine."""
        outs = self.async_stepper.drain() if self.async_stepper is not None else []
        if self.spec is not None and getattr(self.spec, "loop_active", False):
            outs = outs + self.spec.drain_loop(self)
        return outs

    def run_batch(self, batch) -> list[RequestOutput]:
        """One plain step over a scheduled batch (the speculative step falls back to it when nothing is drafted)."""
        order, logits = self.runner.forward_step(batch)
        tokens, logprobs = self.runner.sample(batch, order, logits) if order else ([], [])
        self.num_steps += 1
        register = self.block_manager.register_full_blocks
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            if len(seq.token_ids) == seq.prompt_len:
                self.num_prompt_tokens += n
            register(seq)
        now = time.monotonic()
        seqs, append = batch.seqs, self._append_token
        return [append(seqs[i], t, lp, now) for i, t, lp in zip(order, tokens, logprobs)]

    def _append_token(self, seq: Sequence, token: int, logprob: dict | None, now: float,
                      index: int | None = None) -> RequestOutput:
        """Append a sampled token (or, with async scheduling, commit it at `index`, where a placeholder was
        reserved) and run the stop checks."""
        tids = seq.token_ids
        if index is None:
            tids.append(token)
            n_tokens = len(tids)
        else:
            n_tokens = index + 1  # async: a later placeholder may follow; it does not count
        self.num_generated_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        p, detok, prompt_len = seq.params, seq.detok, seq.prompt_len
        reason = None
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            reason = "stop"
        elif detok.add((token,)):
            reason = "stop"
        elif n_tokens - prompt_len >= p.max_tokens or n_tokens >= self.max_model_len:
            reason = "length"
        return self._output(seq, [token], tids[prompt_len:n_tokens], reason, now,
                            [logprob] if logprob is not None else None)

    def _append_tokens(self, seq: Sequence, tokens: list[int], now: float) -> RequestOutput:
        """Several tokens of one step (speculative decoding) with one detokenizer call and one output: the same
        result as _append_token per token (stops at the first stop token / length limit), for requests without
        stop strings (those need the per-token path to know which token completed the string)."""
        p, detok, prompt_len, tids = seq.params, seq.detok, seq.prompt_len, seq.token_ids
        if p.stop or len(tokens) == 1:
            out = None
            for t in tokens:
                o = self._append_token(seq, t, None, now)
                out = o if out is None else _merge_outputs(out, o)
                if o.finished:
                    break
            return out
        reason, n0 = None, len(tids)
        stops, eos = p.stop_token_ids, (() if p.ignore_eos else self.eos_token_ids)
        limit = min(prompt_len + p.max_tokens, self.max_model_len)  # token count at which "length" stops
        kept = tokens
        for i, t in enumerate(tokens):
            if t in stops or t in eos:
                reason, kept = "stop", tokens[:i + 1]
                break
            if n0 + i + 1 >= limit:
                reason, kept = "length", tokens[:i + 1]
                break
        tids.extend(kept)
        self.num_generated_tokens += len(kept)
        if seq.first_token_time is None:
            seq.first_token_time = now
        detok.add(kept)
        return self._output(seq, list(kept), tids[prompt_len:], reason, now, None)

    def _output(self, seq: Sequence, new_ids: list[int], output_ids: list[int], reason: str | None, now: float,
                logprobs: list | None) -> RequestOutput:
        """The step's output of seq; a finish reason ends the request (the scheduler frees its blocks)."""
        finished = reason is not None
        if finished:
            self.scheduler.finish(seq, reason)
            self.seqs.pop(seq.request_id, None)
        out = RequestOutput(seq.request_id, new_ids, output_ids, seq.detok.take_delta(finished), finished,
                            reason, seq.prompt_len, seq.num_cached_tokens, logprobs)
        out.text = seq.detok.text
        if finished:
            out.metrics = {"arrival_time": seq.arrival_time, "first_token_time": seq.first_token_time,
                           "finished_time": now}
        return out

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Offline: run every prompt to completion; returns the final RequestOutput of each, in order
        (output_token_ids complete; `.text` holds the full text)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        base = f"gen-{time.monotonic_ns()}-"
        ids = [base + str(i) for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids) and self.has_unfinished():
            for out in self.step():
                if out.finished and out.request_id in ids:
                    final[out.request_id] = out
        self.drain()  # async: nothing left running (a discarded extra step) once the caller gets the results
        return [final[r] for r in ids]

    def _swa_stats(self) -> dict:
        return {**self.block_manager.swa_stats(), "swa_replayed_tokens": self.runner.kv_groups.num_replayed_tokens}

    def stats(self) -> dict:
        s = self.scheduler
        return {
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "kv_usage": self.block_manager.usage,
            "num_kv_blocks": self.block_manager.num_blocks,
            "num_free_kv_blocks": self.block_manager.num_free_blocks,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "num_preemptions": s.num_preemptions,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "num_steps": self.num_steps,
            **({"async_wait_s": self.async_stepper.wait_s} if self.async_stepper is not None else {}),
            **(self.spec.stats() if self.spec is not None else {}),
            **(self._swa_stats() if self.swa_plan is not None else {}),
            **(self.block_manager.offload.stats() if self.block_manager.offload is not None else {}),
        }


def _merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Fold the output of a later token of the same step into the first one."""
    a.new_token_ids = a.new_token_ids + b.new_token_ids
    a.output_token_ids = b.output_token_ids
    a.new_text = a.new_text + b.new_text
    if b.logprobs is not None:
        a.logprobs = (a.logprobs or []) + b.logprobs
    a.finished, a.finish_reason, a.metrics, a.text = b.finished, b.finish_reason, b.metrics, b.text
    return a
