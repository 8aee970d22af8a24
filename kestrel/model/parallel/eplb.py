"""Expert placement for expert parallelism, with hot-expert replication (the idea of DeepSeek's EPLB).

Each of `num_ranks` ranks holds `slots_per_rank` physical experts; there are num_logical + num_redundant slots in
all. Redundant slots go, one at a time, to the expert with the highest load per copy; then the copies (each
carrying load / copies) are packed largest-first onto the least-loaded rank that still has a free slot and does
not already hold that expert. Tokens routed to a replicated expert are spread over its copies.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    num_logical: int
    num_ranks: int
    phys_to_logical: tuple[int, ...]  # rank r holds physical slots [r * slots_per_rank, (r + 1) * slots_per_rank)

    @property
    def slots_per_rank(self) -> int:
        return len(self.phys_to_logical) // self.num_ranks

    def replicas(self) -> list[list[int]]:
        """logical expert -> its physical slots."""
        out: list[list[int]] = [[] for _ in range(self.num_logical)]
        for p, e in enumerate(self.phys_to_logical):
            out[e].append(p)
        return out

    def local_experts(self, rank: int) -> list[int]:
        s = self.slots_per_rank
        return list(self.phys_to_logical[rank * s:(rank + 1) * s])

    def rank_loads(self, load) -> list[float]:
        """Expected tokens per rank for per-expert `load`, copies sharing their expert's load evenly."""
        load = [float(v) for v in load]
        reps = self.replicas()
        return [sum(load[e] / len(reps[e]) for e in self.local_experts(r)) for r in range(self.num_ranks)]


def contiguous_placement(num_experts: int, num_ranks: int) -> ExpertPlacement:
    if num_experts % num_ranks:
        raise ValueError(f"{num_experts} experts cannot be split evenly over expert-parallel size {num_ranks}")
    return ExpertPlacement(num_experts, num_ranks, tuple(range(num_experts)))


def plan_placement(load, num_ranks: int, num_redundant: int = 0) -> ExpertPlacement:
    """Placement for per-expert token counts `load` [E] with `num_redundant` extra copies in all."""
    load = [float(v) for v in (load.tolist() if isinstance(load, torch.Tensor) else load)]
    E = len(load)
    total = E + num_redundant
    if num_redundant < 0 or total % num_ranks:
        raise ValueError(f"{E} experts + {num_redundant} redundant copies must split evenly over {num_ranks} ranks")
    slots = total // num_ranks
    if num_redundant > E * (num_ranks - 1):
        raise ValueError(f"{num_redundant} redundant copies exceed one copy of every expert on every rank")
    copies = [1] * E
    for _ in range(num_redundant):  # a rank never needs two copies of one expert
        e = max((i for i in range(E) if copies[i] < num_ranks), key=lambda i: (load[i] / copies[i], -i))
        copies[e] += 1
    items = sorted(((load[e] / copies[e], e) for e in range(E) for _ in range(copies[e])), key=lambda t: (-t[0], t[1]))
    held: list[list[int]] = [[] for _ in range(num_ranks)]
    rank_load = [0.0] * num_ranks
    for w, e in items:
        free = [r for r in range(num_ranks) if len(held[r]) < slots]
        fresh = [r for r in free if e not in held[r]] or free
        r = min(fresh, key=lambda i: (rank_load[i], i))
        held[r].append(e)
        rank_load[r] += w
    return ExpertPlacement(E, num_ranks, tuple(e for r in range(num_ranks) for e in sorted(held[r])))
