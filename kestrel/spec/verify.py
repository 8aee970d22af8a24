"""Lossless verification of draft tokens against the target model, batched over requests whose drafts have
different lengths (padded [B, K] tensors + a lengths vector).

Convention: position i of the target tensors is the target's prediction after the first i draft tokens were
appended, so row b has valid target positions 0..lens[b] (lens[b] + 1 of them; the last one gives the bonus token).
Both functions return (tokens [B, K+1], num_accepted [B]): row b emits tokens[b, :num_accepted[b] + 1]; the rest is
padded with -1.
"""
from __future__ import annotations

import torch


def _emit(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Accepted draft prefix + one target-sampled token at index num_accepted, -1 beyond."""
    B, K = draft_tokens.shape
    out = torch.cat([draft_tokens, draft_tokens.new_zeros(B, 1)], dim=1)
    out.scatter_(1, num_accepted[:, None], last[:, None].to(out.dtype))
    pos = torch.arange(K + 1, device=out.device)[None, :]
    return out.masked_fill(pos > num_accepted[:, None], -1)


def _num_accepted(accept: torch.Tensor, draft_lens: torch.Tensor) -> torch.Tensor:
    """Length of the all-accepted prefix; positions past a row's draft length never count."""
    K = accept.shape[1]
    valid = torch.arange(K, device=accept.device)[None, :] < draft_lens[:, None]
    return (accept & valid).long().cumprod(dim=1).sum(dim=1)


def verify_greedy(draft_tokens: torch.Tensor, draft_lens: torch.Tensor, target_tokens: torch.Tensor):
    """Greedy: accept the longest prefix where draft == target argmax, then emit the target's own next token.

    target_tokens: [B, K+1] argmax of the target at every position. Because accepted drafts equal the target's
    tokens, the output is exactly what plain greedy decoding would produce.
    """
    K = draft_tokens.shape[1]
    match = draft_tokens == target_tokens[:, :K]
    a = _num_accepted(match, draft_lens)
    last = target_tokens.gather(1, a[:, None]).squeeze(1)
    return _emit(draft_tokens, a, last), a


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)) row-wise: the distribution to resample from after a rejection. Where p == q
    numerically (rejection then had probability ~0) fall back to p so the result is always a distribution."""
    r = (p - q).clamp_min(0)
    s = r.sum(-1, keepdim=True)
    return torch.where(s > 1e-12, r / s.clamp_min(1e-30), p)


def verify_sampling(
    draft_tokens: torch.Tensor,
    draft_lens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
):
    """Speculative rejection sampling (Leviathan et al. / Chen et al.): accept draft token d_i with probability
    min(1, p_i(d_i) / q_i(d_i)); at the first rejection resample from normalize(max(0, p_i - q_i)) and stop; if every
    draft token is accepted, sample a bonus token from p_{len}. The emitted tokens are distributed exactly as
    sampling from the target one token at a time.

    target_probs: [B, K+1, V] (already temperature/top-k/top-p processed). draft_probs: [B, K, V], the
    distributions the draft tokens were sampled from; None means a deterministic drafter (q = one-hot(d)), e.g.
    n-gram lookup or a greedy draft.
    """
    B, K = draft_tokens.shape
    dev = target_probs.device
    rows = torch.arange(B, device=dev)
    if K == 0:
        last = torch.multinomial(target_probs[:, 0].float(), 1, generator=generator).squeeze(1)
        a = torch.zeros(B, dtype=torch.long, device=dev)
        return _emit(draft_tokens, a, last), a

    p_d = target_probs[:, :K].gather(-1, draft_tokens[..., None]).squeeze(-1).float()
    q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1).float()
    u = torch.rand(B, K, device=dev, generator=generator)
    accept = u * q_d < p_d  # u < p/q without dividing by q; p == 0 never accepts
    a = _num_accepted(accept, draft_lens)

    # Only the distribution at index a matters per row: B x V work, not B x K x V.
    p_a = target_probs[rows, a].float()
    rejected = a < draft_lens
    a_q = a.clamp(max=K - 1)
    if draft_probs is None:
        q_a = torch.zeros_like(p_a)
        q_a[rows, draft_tokens[rows, a_q]] = 1.0
    else:
        q_a = draft_probs[rows, a_q].float()
    dist = torch.where(rejected[:, None], residual_distribution(p_a, q_a), p_a)
    last = torch.multinomial(dist, 1, generator=generator).squeeze(1)
    return _emit(draft_tokens, a, last), a
