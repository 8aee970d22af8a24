"""Vocabulary-parallel embedding and LM head: rank r holds token rows [r*V/p, (r+1)*V/p) (the last rank's slice
padded with zero rows so every rank's shard has the same shape, which all-gather needs).

Embedding: each rank looks up the ids it owns, writes zeros for the rest, and an all-reduce sums the one non-zero
row per token: the result equals the unsharded lookup exactly. LM head: each rank computes its vocabulary slice
of the logits and an all-gather concatenates them (padding columns dropped). A tied LM head reuses the embedding
shard, as the unsharded model shares one matrix."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .distributed import ParallelGroup


def vocab_range(vocab_size: int, group: ParallelGroup) -> tuple[int, int, int]:
    """-> (start, end, padded rows per rank) of this rank's slice."""
    per = -(-vocab_size // group.size)
    start = min(group.rank * per, vocab_size)
    return start, min(start + per, vocab_size), per


def _shard_rows(w: torch.Tensor, start: int, end: int, per: int) -> torch.Tensor:
    out = w.new_zeros((per, w.shape[1]))
    out[: end - start] = w[start:end]
    return out


def _is_quant_or_biased(m: nn.Module) -> bool:
    return hasattr(m, "qweight_struct") or getattr(m, "bias", None) is not None


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight_shard: torch.Tensor, vocab_size: int, group: ParallelGroup):
        super().__init__()
        self.vocab_size, self.group = vocab_size, group
        self.start, self.end, self.per = vocab_range(vocab_size, group)
        self.weight = nn.Parameter(weight_shard, requires_grad=False)

    @classmethod
    def from_full(cls, emb: nn.Embedding, group: ParallelGroup) -> "VocabParallelEmbedding":
        s, e, per = vocab_range(emb.num_embeddings, group)
        return cls(_shard_rows(emb.weight.detach(), s, e, per), emb.num_embeddings, group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(ids, self.weight)
        own = (ids >= self.start) & (ids < self.end)
        local = torch.where(own, ids - self.start, torch.zeros_like(ids))
        x = F.embedding(local, self.weight) * own.unsqueeze(-1).to(self.weight.dtype)
        return self.group.all_reduce(x)


class ParallelLMHead(nn.Module):
    """logits = all_gather(hidden @ W_r^T)[:, :vocab]; every rank ends with the full logits."""

    def __init__(self, weight_shard: torch.Tensor | nn.Parameter, vocab_size: int, group: ParallelGroup):
        super().__init__()
        self.vocab_size, self.group = vocab_size, group
        self.weight = weight_shard if isinstance(weight_shard, nn.Parameter) else \
            nn.Parameter(weight_shard, requires_grad=False)

    @classmethod
    def from_full(cls, head: nn.Module, vocab_size: int, group: ParallelGroup,
                  tied: VocabParallelEmbedding | None = None) -> "ParallelLMHead":
        if tied is not None:
            return cls(tied.weight, vocab_size, group)
        w = getattr(head, "weight", None)
        if _is_quant_or_biased(head) or not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise ValueError("the vocab-parallel LM head supports a float linear layer without bias")
        s, e, per = vocab_range(vocab_size, group)
        return cls(_shard_rows(head.weight.detach(), s, e, per), vocab_size, group)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight)
        if self.group.size == 1:
            return local[..., : self.vocab_size]
        return self.group.all_gather_cat(local, -1)[..., : self.vocab_size]
