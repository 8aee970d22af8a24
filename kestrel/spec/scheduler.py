"""How many draft tokens to verify per request this step.

Verification is cheap while the batch's forward is memory-bound: up to roughly `token_budget` query tokens per step
cost about the same as one token per request. So the confidence scheduler spends only the spare part of that budget
(token_budget - batch size) on draft tokens, giving it to the tokens most likely to survive (cumulative product of
the drafter's per-token confidence) above a minimum survival probability. As the batch fills the spare budget
shrinks to zero and speculation switches itself off smoothly instead of making every step slower.
"""
from __future__ import annotations

import numpy as np
import torch


class FixedKScheduler:
    """Baseline: verify min(k, drafted) tokens for every request (k=1 is the MTP-1-like baseline)."""

    def __init__(self, k: int):
        self.k = k

    def max_k(self, batch_size: int) -> int:
        return self.k

    def allocate(self, confidence: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        return lens.clamp(max=self.k)


class ConfidenceScheduler:
    def __init__(self, k_max: int, token_budget: int, min_survival: float = 0.3):
        self.k_max, self.token_budget, self.min_survival = k_max, token_budget, min_survival

    def spare_budget(self, batch_size: int) -> int:
        """Draft tokens this step may add on top of one token per request; non-increasing in batch size."""
        return max(0, self.token_budget - batch_size)

    def threshold(self, batch_size: int) -> float:
        """Survival probability a draft token needs to be verified. Constant: inside the spare budget a verified
        token costs ~nothing, so any token likely enough to survive is worth it; load is handled by the budget."""
        return self.min_survival

    def max_k(self, batch_size: int) -> int:
        """Upper bound before drafting (0 = don't even draft)."""
        return min(self.k_max, self.spare_budget(batch_size))

    def allocate(self, confidence: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """confidence [B, K] per-token conditional acceptance; lens [B] tokens drafted. Returns k [B] to verify."""
        B, K = confidence.shape
        budget = min(self.spare_budget(B), B * min(K, self.k_max))
        if K == 0 or budget == 0:
            return torch.zeros(B, dtype=torch.long)
        # numpy on the host: a dozen torch ops on [B, K] cost ~0.1 ms a step in dispatch alone
        conf = confidence.detach().cpu().float().numpy()
        lens = lens.detach().cpu().numpy()
        pos = np.arange(K)[None, :]
        valid = (pos < lens[:, None]) & (pos < self.k_max)
        survival = np.where(valid, np.cumprod(np.clip(conf, 0, 1), axis=1), np.float32(0))
        eligible = survival >= self.threshold(B)
        n = min(budget, int(eligible.sum()))
        if n == 0:
            return torch.zeros(B, dtype=torch.long)
        flat = np.where(eligible, survival, np.float32(-1)).ravel()
        chosen = np.argsort(-flat, kind="stable")[:n]  # ties: earlier rows first
        # survival is non-increasing along a row, so counting a row's chosen tokens gives a verifiable prefix
        return torch.from_numpy(np.bincount(chosen // K, minlength=B).astype(np.int64))


DEFAULT_TOKEN_BUDGET = {"cpu": 8, "cuda": 256}


def make_scheduler(cfg, device: str = "cpu"):
    if cfg.schedule == "fixed":
        return FixedKScheduler(cfg.k)
    budget = cfg.token_budget or DEFAULT_TOKEN_BUDGET.get(str(device).split(":")[0], 256)
    return ConfidenceScheduler(cfg.k, budget, cfg.min_survival)
