"""Data-parallel attention: each rank runs attention (and its own scheduler and KV cache) for its own requests,
with replicated attention weights, while the MoE / MLP layers are shared across ranks (expert parallelism, or a
tensor-parallel MLP fed with everyone's tokens). Attention needs no communication; the shared layers do, so all
ranks must step together: a rank with nothing to run still runs a dummy forward, joining every collective.

`dp_generate` drives one rank's LLMEngine that way; `DPGatheredMLP` wraps a tensor-parallel dense MLP so that a
rank's tokens are gathered from all ranks before it and its own rows kept after it.
"""
from __future__ import annotations

import torch
from torch import nn

from .distributed import ParallelGroup


class _NoAttention:
    """Context of a dummy step: attention is skipped (zeros), the other layers run as usual."""

    def attention(self, layer, q, k, v):
        return q.new_zeros(q.shape[0], q.shape[1] * q.shape[2])


@torch.inference_mode()
def empty_forward(model: nn.Module) -> None:
    """A dummy one-token forward (as vLLM's idle data-parallel ranks run): it touches no KV cache, but joins every
    collective of the shared layers. Its token is counted in the MoE load statistics like any other."""
    p = next(model.parameters())
    ids = torch.zeros(1, dtype=torch.long, device=p.device)
    model(ids, ids.clone(), _NoAttention())


def dp_generate(engine, prompts, params, group: ParallelGroup):
    """Run this rank's prompts to completion in lockstep with the other data-parallel ranks (every rank calls it
    with its own prompts, possibly none). Returns this rank's final RequestOutputs, in order."""
    # lockstep needs each step's forward to run inside step(): run the engine synchronously meanwhile
    engine.drain()
    stepper, engine.async_stepper = engine.async_stepper, None
    ids = [f"dp{group.rank}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    ran = [0]
    inner = engine.runner.forward_step

    def counted(batch):
        ran[0] += 1
        return inner(batch)
    engine.runner.forward_step = counted
    final = {}
    dev = next(engine.runner.model.parameters()).device
    try:
        while True:
            mine = engine.has_unfinished()
            if int(group.all_reduce(torch.tensor([int(mine)], device=dev)).item()) == 0:
                break
            before = ran[0]
            if mine:
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = out
            if ran[0] == before:  # nothing ran here this step: join the others' collectives with an empty batch
                empty_forward(engine.runner.model)
    finally:
        engine.runner.forward_step = inner
        engine.async_stepper = stepper
    return [final[r] for r in ids]


class DPGatheredMLP(nn.Module):
    """Tensor-parallel MLP under data-parallel attention: all-gather every rank's tokens, run the TP MLP (its
    row-parallel all-reduce leaves the full result on every rank), keep this rank's rows."""

    def __init__(self, mlp: nn.Module, group: ParallelGroup):
        super().__init__()
        self.mlp, self.group = mlp, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return self.mlp(x)
        full, sizes = self.group.all_gather_varlen(x)
        y = self.mlp(full)
        start = sum(sizes[: self.group.rank])
        return y[start:start + x.shape[0]]
