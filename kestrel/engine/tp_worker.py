"""Tensor-parallel engine: one process per rank; rank 0 runs the scheduler, sampler and server, every rank runs
its shard of the model.

Each step rank 0 broadcasts the scheduled batch in a light, picklable form (per sequence: the tokens from the
first uncomputed one on, the computed count, the block table), then all ranks run the same ModelRunner step on
it in lockstep; the collectives inside the model (row-parallel all-reduce, vocab all-gather) line the ranks up.
All ranks hold identical block tables because only rank 0 allocates blocks and the tables travel with the batch.
Only rank 0 samples; the others drop their logits.

Process layout (`launch_tp_engine`): the calling process is rank 0; ranks 1..N-1 are spawned processes that build
the same engine and then loop in `worker_loop` until rank 0 broadcasts the stop message. A watchdog ends rank 0
with a message if a worker dies, instead of leaving it blocked in a collective.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from dataclasses import dataclass, replace

import torch

from kestrel.model.parallel import ParallelGroup, destroy_distributed, init_distributed, shard_llama
from kestrel.model.parallel.distributed import apply_nccl_env, free_port

from .block_manager import BlockManager
from .config import EngineConfig
from .llm_engine import LLMEngine, size_kv_cache
from .model_runner import ModelRunner
from .scheduler import ScheduledBatch, Scheduler


class _TokenWindow:
    """token_ids[start:] of a sequence, indexed with absolute positions (what ModelRunner reads: [-1], [a:b])."""

    __slots__ = ("start", "toks", "total")

    def __init__(self, start: int, toks: list[int]):
        self.start, self.toks, self.total = start, toks, start + len(toks)

    def __len__(self):
        return self.total

    def __getitem__(self, i):
        if isinstance(i, slice):
            a, b, _ = i.indices(self.total)
            if a < self.start:
                raise IndexError("token window does not reach that far back")
            return self.toks[a - self.start:b - self.start]
        i = i + self.total if i < 0 else i
        return self.toks[i - self.start]


@dataclass
class _SeqView:
    token_ids: _TokenWindow
    num_computed_tokens: int
    block_table: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def light_batch(batch: ScheduledBatch) -> ScheduledBatch:
    seqs = []
    for s in batch.seqs:
        start = min(s.num_computed_tokens, s.num_tokens - 1)
        seqs.append(_SeqView(_TokenWindow(start, s.token_ids[start:]), s.num_computed_tokens, list(s.block_table)))
    return ScheduledBatch(seqs, list(batch.num_new_tokens))


class TPModelRunner(ModelRunner):
    def __init__(self, *args, group: ParallelGroup, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group
        self.lock = threading.Lock()  # held while rank 0 is inside a step's collectives

    def forward_step(self, batch: ScheduledBatch):
        """Rank 0: broadcast the step, then run it like every other rank."""
        with self.lock:
            lb = self.group.broadcast_object(("step", light_batch(batch)))[1]
            return super().forward_step(lb)

    def stop_workers(self) -> None:
        with self.lock:
            self.group.broadcast_object(("stop", None))

    def worker_loop(self) -> None:
        """Ranks > 0: run every step rank 0 broadcasts, until it says stop."""
        while True:
            kind, lb = self.group.broadcast_object(None)
            if kind == "stop":
                return
            super().forward_step(lb)


class TPLLMEngine(LLMEngine):
    """LLMEngine whose model is this rank's tensor-parallel shard. Build it on every rank (same config); rank 0
    is used like any LLMEngine, ranks > 0 call `worker_loop()`."""

    def __init__(self, config: EngineConfig, group: ParallelGroup, device: torch.device | str | None = None):
        if getattr(config, "speculative", None) is not None:
            raise ValueError("speculative decoding is not supported with tensor parallelism yet")
        if getattr(config, "kv_offload_gb", 0) > 0:
            raise ValueError("KV offload is not supported with tensor parallelism yet")
        device = str(device or config.device)
        # the base class loads the full model (and tokenizer, quantization) with a one-block KV cache; the real
        # cache is sized below from the per-rank KV heads
        super().__init__(replace(config, device=device, num_kv_blocks=1, max_model_len=None))
        self.config, self.group, self.tp_size = config, group, group.size
        self.rank_config = rc = shard_llama(self.model, group)
        bs = config.block_size
        num_blocks, self.max_model_len = size_kv_cache(config, self.model_config, kv_heads=rc.num_key_value_heads)
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len)
        self.runner = TPModelRunner(self.model, rc, num_blocks, bs, config.torch_dtype, device, config.seed,
                                    group=group)
        self._workers: list = []
        self._stopped = False

    def worker_loop(self) -> None:
        self.runner.worker_loop()

    def stats(self) -> dict:
        return {**super().stats(), "tensor_parallel_size": self.tp_size}

    def at_exit(self) -> None:
        """Interpreter exit: stop the workers cleanly unless another thread is stuck inside a step, then kill."""
        if self._stopped:
            return
        if self.runner.lock.acquire(timeout=2.0):
            self.runner.lock.release()
            self.shutdown()
        self._stopped = True
        for p in self._workers:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def shutdown(self) -> None:
        """Rank 0: release the workers and wait for them (idempotent)."""
        if self._stopped or self.group.rank != 0:
            return
        self._stopped = True
        if self.group.size > 1:
            self.runner.stop_workers()
        for p in self._workers:
            p.join(timeout=30)
        destroy_distributed()


def run_rank(rank: int, world_size: int, config: EngineConfig, init_method: str, driver=None):
    """Body of one rank: build the shard; rank 0 returns driver(engine) (then stops the workers), others serve
    steps until stopped. Used by tests (forked ranks) and by `_worker_main`."""
    group, device = init_distributed(rank, world_size, init_method, config.device)
    engine = TPLLMEngine(config, group, device)
    if rank != 0:
        engine.worker_loop()
        destroy_distributed()
        return None
    try:
        return driver(engine) if driver is not None else None
    finally:
        engine.shutdown()


def _worker_main(rank: int, world_size: int, config: EngineConfig, init_method: str) -> None:
    try:
        run_rank(rank, world_size, config, init_method)
    except KeyboardInterrupt:
        pass


def _watchdog(engine: TPLLMEngine) -> None:
    while not engine._stopped:
        for p in engine._workers:
            if p.exitcode not in (None, 0) and not engine._stopped:
                print(f"kestrel: tensor-parallel worker (pid {p.pid}) exited with code {p.exitcode}; stopping",
                      file=sys.stderr, flush=True)
                os._exit(1)
        time.sleep(1.0)


def launch_tp_engine(config: EngineConfig, tensor_parallel_size: int, start_method: str = "spawn") -> TPLLMEngine:
    """This process becomes rank 0 of an N-process tensor-parallel engine; ranks 1..N-1 are started here."""
    import torch.multiprocessing as mp

    n = int(tensor_parallel_size)
    if n < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {n}")
    if config.device.startswith("cuda"):
        if not torch.cuda.is_available() or torch.cuda.device_count() < n:
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise ValueError(f"--tensor-parallel-size {n} needs {n} GPUs, {have} visible")
    apply_nccl_env()  # before the workers start: they inherit it
    init_method = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context(start_method)
    workers = []
    for r in range(1, n):
        p = ctx.Process(target=_worker_main, args=(r, n, config, init_method), daemon=True)
        p.start()
        workers.append(p)
    try:
        group, device = init_distributed(0, n, init_method, config.device)
        engine = TPLLMEngine(config, group, device)
    except BaseException:
        for p in workers:
            p.kill()
        raise
    engine._workers = workers
    if workers:
        threading.Thread(target=_watchdog, args=(engine,), daemon=True, name="tp-watchdog").start()
        atexit.register(engine.at_exit)
    return engine
