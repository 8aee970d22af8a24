"""Process groups for tensor / expert parallelism: one process per device, collectives through torch.distributed
(NCCL on GPUs, gloo on the CPU for CI).

Layers take a `ParallelGroup` explicitly instead of reading globals, so a test can run TP and EP groups side by
side and a size-1 group makes every collective a no-op (the TP=1 path runs the very same modules).
"""
from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

# NVLink multicast (NVLS) stays off: on shared multi-GPU hosts a program using it can take the host's GPUs out of
# service, and NCCL, PyTorch symmetric memory and NVSHMEM each have their own switch. Forced (not defaulted), and
# set before the first communicator exists and before worker processes start, so they inherit it.
NCCL_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def apply_nccl_env() -> None:
    for k, v in NCCL_SAFE_ENV.items():
        os.environ[k] = v


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ParallelGroup:
    """rank/size within one process group (pg None = the default world group)."""
    rank: int = 0
    size: int = 1
    pg: object = None
    # optional context-manager factory wrapped around every all-reduce (bench/tp_decode.py times them with it)
    comm_timer: Callable | None = field(default=None, repr=False)
    # gloo group over the same ranks for host-side control messages (step broadcasts): with NCCL they would
    # cost a host->device copy and a stream sync per step
    cpu_pg: object = field(default=None, repr=False)

    def _timed(self):
        return self.comm_timer() if self.comm_timer is not None else contextlib.nullcontext()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            with self._timed():
                dist.all_reduce(x, group=self.pg)
        return x

    def all_gather_cat(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate equal-shaped tensors of every rank along `dim` (rank order)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        with self._timed():
            dist.all_gather(parts, x.contiguous(), group=self.pg)
        return torch.cat(parts, dim=dim)

    def all_gather_varlen(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Concatenate along dim 0 tensors whose first dimension differs per rank -> (cat, sizes per rank)."""
        if self.size == 1:
            return x, [x.shape[0]]
        n = torch.tensor([x.shape[0]], dtype=torch.long, device=x.device)
        sizes = self.all_gather_cat(n, 0).tolist()
        m = max(sizes)
        pad = x.new_zeros((m,) + tuple(x.shape[1:]))
        pad[: x.shape[0]] = x
        full = self.all_gather_cat(pad, 0).view(self.size, m, *x.shape[1:])
        return torch.cat([full[r, : sizes[r]] for r in range(self.size)]), sizes

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """Rows x[sum(send_counts[:r]) : ...] go to rank r; returns the rows received, grouped by source rank."""
        if self.size == 1:
            return x.clone()
        out = x.new_empty((sum(recv_counts),) + tuple(x.shape[1:]))
        with self._timed():
            dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=self.pg)
        return out

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """send_counts [size] (rows this rank sends to each rank) -> recv_counts [size]."""
        if self.size == 1:
            return send_counts.clone()
        out = torch.empty_like(send_counts)
        dist.all_to_all_single(out, send_counts.contiguous(), group=self.pg)
        return out

    def broadcast_object(self, obj=None, src: int = 0):
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.cpu_pg if self.cpu_pg is not None else self.pg)
        return box[0]

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.pg)


def init_distributed(rank: int, world_size: int, init_method: str, device: str = "cpu",
                     timeout_s: float = 600.0) -> tuple[ParallelGroup, torch.device]:
    """Join the world group (NCCL for cuda devices, gloo otherwise). Returns (group, this rank's device).
    Rank r drives cuda:r, so one host with N GPUs runs N processes."""
    import datetime

    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    dev = torch.device(device)
    if dev.type == "cuda":
        apply_nccl_env()
        if torch.cuda.device_count() < world_size:
            raise ValueError(f"tensor parallel size {world_size} needs {world_size} GPUs, "
                             f"{torch.cuda.device_count()} visible")
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
        backend = "nccl"
    else:
        backend = "gloo"
    if world_size == 1:
        return ParallelGroup(), dev
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    cpu_pg = dist.new_group(backend="gloo", timeout=timeout)  # (also on the CPU, so CI runs this path)
    return ParallelGroup(rank=rank, size=world_size, cpu_pg=cpu_pg), dev


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def spawn_ranks(target: Callable, world_size: int, args: tuple = (), timeout: float = 600.0):
    """Run target(rank, init_method, queue, *args) in `world_size` spawned processes. One rank reports by putting
    ("ok", value) or ("error", message) on the queue; returns that value (raises on an error or a silent timeout),
    then joins the ranks and kills any that hang."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=target, args=(r, init_method, queue, *args)) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        status, value = queue.get(timeout=timeout)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if status != "ok":
        raise RuntimeError(value)
    return value
