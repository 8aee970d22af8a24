"""The one interface every drafter implements, and the batch it returns."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class DraftInput:
    """What a drafter sees of one running request."""
    request_id: str
    token_ids: list[int]  # prompt + every accepted output token (the last one is not in the KV cache yet)
    temperature: float = 0.0  # 0 = greedy: draft argmax; > 0: sample and report q
    hidden: torch.Tensor | None = None  # target's final hidden state [H] at the position that produced token_ids[-1]


@dataclass
class Draft:
    """Padded draft batch. Row b proposes tokens[b, :lens[b]]."""
    tokens: torch.Tensor  # [B, K] long
    lens: torch.Tensor  # [B] long
    confidence: torch.Tensor  # [B, K] float: P(token i accepted | tokens < i accepted), in [0, 1]
    probs: torch.Tensor | None = None  # [B, K, V] the q each token was sampled from; None = deterministic draft

    @staticmethod
    def empty(batch: int, device="cpu") -> "Draft":
        z = torch.zeros(batch, 0, dtype=torch.long, device=device)
        return Draft(z, torch.zeros(batch, dtype=torch.long, device=device), torch.zeros(batch, 0, device=device))

    def truncate(self, k: torch.Tensor) -> "Draft":
        """Keep at most k[b] tokens per row (what the scheduler decided to verify) and trim padding columns."""
        lens = torch.minimum(self.lens, k.to(self.lens))
        K = int(lens.max()) if lens.numel() else 0
        probs = None if self.probs is None else self.probs[:, :K]
        return Draft(self.tokens[:, :K], lens, self.confidence[:, :K], probs)


class Drafter(ABC):
    needs_hidden: bool = False  # True: the engine must hand the target's last hidden state in DraftInput.hidden

    @abstractmethod
    def propose(self, inputs: list[DraftInput], k: int) -> Draft:
        """Propose up to k tokens for each request."""

    def observe(self, request_ids: list[str], num_proposed: list[int], num_accepted: list[int]) -> None:
        """Feedback after verification (used to calibrate confidence)."""

    def release(self, request_id: str) -> None:
        """The request finished or was aborted: drop any per-request state."""
