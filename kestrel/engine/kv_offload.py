"""Host-memory tier for the prefix cache (KV offload).

When the block manager reuses a free block that still holds a cached prefix, the block's K/V (every layer) is
copied into a pool of host memory first (pinned when CUDA is present, so copies can overlap compute), keyed by
the block's chained hash. A later prompt whose prefix misses on the device but hits here gets a fresh device
block filled from the host copy instead of recomputing it. The host pool is LRU-bounded; with `disk_dir` set,
blocks evicted from host memory are written as safetensors files and can be read back from there (a third tier).
"""
from __future__ import annotations

import os
from collections import OrderedDict

import torch


class HostKVTier:
    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], capacity_blocks: int,
                 disk_dir: str | None = None, disk_capacity_blocks: int = 0):
        if capacity_blocks < 1:
            raise ValueError("the host KV tier needs room for at least one block")
        self.k_caches, self.v_caches = k_caches, v_caches
        shape = (capacity_blocks, len(k_caches), 2, *k_caches[0].shape[1:])  # [slot, layer, k|v, bs, heads, dim]
        pin = torch.cuda.is_available() and k_caches[0].is_cuda
        self.pool = torch.empty(shape, dtype=k_caches[0].dtype, pin_memory=pin)
        self.entries: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()  # hash -> (slot, tokens)
        self.free_slots = list(range(capacity_blocks - 1, -1, -1))
        self.disk_dir, self.disk_capacity = disk_dir, disk_capacity_blocks
        self.disk: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        if disk_dir:
            os.makedirs(disk_dir, exist_ok=True)
        self.num_offloaded = self.num_restored = self.num_disk_writes = self.num_disk_reads = 0

    @staticmethod
    def bytes_per_block(k_caches) -> int:
        return 2 * len(k_caches) * k_caches[0][0].numel() * k_caches[0].element_size()

    def __contains__(self, h: int) -> bool:
        return h in self.entries or h in self.disk

    def _disk_path(self, h: int) -> str:
        return os.path.join(self.disk_dir, f"{h & (2**64 - 1):016x}.safetensors")

    def _spill(self) -> int:
        """Free a host slot: drop (or write to disk) the least recently used entry."""
        h, (slot, tokens) = self.entries.popitem(last=False)
        if self.disk_dir and self.disk_capacity > 0:
            from safetensors.torch import save_file
            save_file({"kv": self.pool[slot].contiguous(), "tokens": torch.tensor(tokens, dtype=torch.int64)},
                      self._disk_path(h))
            self.disk[h] = tokens
            self.num_disk_writes += 1
            while len(self.disk) > self.disk_capacity:
                old, _ = self.disk.popitem(last=False)
                os.remove(self._disk_path(old))
        return slot

    def save(self, h: int, tokens: tuple[int, ...], block_id: int) -> None:
        """Called just before device block `block_id` (holding prefix block `h`) is overwritten."""
        if h in self.entries:
            self.entries.move_to_end(h)
            return
        slot = self.free_slots.pop() if self.free_slots else self._spill()
        dst = self.pool[slot]
        for layer, (k, v) in enumerate(zip(self.k_caches, self.v_caches)):
            dst[layer, 0].copy_(k[block_id], non_blocking=True)
            dst[layer, 1].copy_(v[block_id], non_blocking=True)
        self.entries[h] = (slot, tokens)
        self.num_offloaded += 1

    def load(self, h: int, tokens: tuple[int, ...], block_id: int) -> bool:
        """Fill device block `block_id` with prefix block `h` if a tier holds it (and its tokens match)."""
        if h in self.entries:
            slot, held = self.entries[h]
            if held != tokens:
                return False
            self.entries.move_to_end(h)
            src = self.pool[slot]
        elif h in self.disk and self.disk[h] == tokens:
            from safetensors.torch import load_file
            src = load_file(self._disk_path(h))["kv"]
            self.disk.move_to_end(h)
            self.num_disk_reads += 1
        else:
            return False
        for layer, (k, v) in enumerate(zip(self.k_caches, self.v_caches)):
            k[block_id].copy_(src[layer, 0], non_blocking=True)
            v[block_id].copy_(src[layer, 1], non_blocking=True)
        if self.k_caches[0].is_cuda:
            torch.cuda.current_stream().synchronize()  # the host buffer may be reused right after
        self.num_restored += 1
        return True

    def stats(self) -> dict:
        return {"kv_offload_blocks": len(self.entries), "kv_offload_saved": self.num_offloaded,
                "kv_offload_restored": self.num_restored, "kv_offload_disk_blocks": len(self.disk),
                "kv_offload_disk_reads": self.num_disk_reads}
