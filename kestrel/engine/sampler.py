"""Token sampling for one step, batched over the sequences that produce a token.

Order (as in vLLM): penalties on the raw logits -> temperature -> top-k -> top-p -> min-p -> draw.
Greedy rows take argmax of the penalized logits. Seeded requests draw with their own torch.Generator, so their
tokens do not depend on what else is in the batch. Logprobs are of the raw model distribution."""
from __future__ import annotations

import torch

from .attention import to_device
from .sampling_params import SamplingParams


def apply_penalties(logits: torch.Tensor, output_ids: list[list[int]], params: list[SamplingParams]) -> torch.Tensor:
    for i, p in enumerate(params):
        if (p.presence_penalty or p.frequency_penalty) and output_ids[i]:
            ids = torch.tensor(output_ids[i], device=logits.device)
            counts = torch.zeros(logits.shape[-1], device=logits.device).index_add_(
                0, ids, torch.ones(len(ids), device=logits.device))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return logits


def top_k_top_p_min_p_mask(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                           min_p: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (already temperature-scaled); top_k [B] (0 = off), top_p [B], min_p [B].
    Returns logits with removed tokens set to -inf."""
    V = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, V).clamp(max=V)
    remove = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = sorted_logits.softmax(-1)
    # keep the smallest set whose mass reaches top_p: drop a token if the mass before it already reaches top_p
    mass_before = probs.cumsum(-1) - probs
    remove |= mass_before >= top_p[:, None]
    remove |= probs < (min_p[:, None] * probs[:, :1])
    remove[:, 0] = False  # the most likely token always survives
    mask = torch.zeros_like(remove).scatter_(-1, sorted_idx, remove)
    return logits.masked_fill(mask, float("-inf"))


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], output_ids: list[list[int]] | None,
                 generators: list[torch.Generator | None]):
        """logits [B, V] float32; output_ids is read only when a row has penalties (None otherwise).
        Returns (token_ids list[int], logprobs list[dict|None])."""
        raw = logits
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            logits = apply_penalties(logits.clone(), output_ids, params)
        greedy = [p.temperature == 0.0 for p in params]
        if all(greedy):
            tokens = logits.argmax(-1)
        else:
            tokens = logits.argmax(-1)
            rows = [i for i, g in enumerate(greedy) if not g]
            sub = logits[rows]
            dev = sub.device
            temps = torch.tensor([params[i].temperature for i in rows], dtype=sub.dtype, device=dev)
            sub = sub / temps[:, None]
            tk = torch.tensor([max(params[i].top_k, 0) for i in rows], device=dev)
            tp = torch.tensor([params[i].top_p for i in rows], dtype=sub.dtype, device=dev)
            mp = torch.tensor([params[i].min_p for i in rows], dtype=sub.dtype, device=dev)
            if bool((tk > 0).any() or (tp < 1).any() or (mp > 0).any()):
                sub = top_k_top_p_min_p_mask(sub, tk, tp, mp)
            # draw on the CPU: the per-request generators live there, so a seed gives the same tokens on any device
            probs = sub.softmax(-1).float().cpu()
            for j, i in enumerate(rows):
                g = generators[i] or self.generator
                tokens[i] = int(torch.multinomial(probs[j], 1, generator=g)[0])
        token_list = tokens.tolist()
        return token_list, logprob_entries(logprob_tensors(raw, tokens, params), len(params), token_list)


def logprob_tensors(raw: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]):
    """The device half of the logprobs: for the rows that asked (want), the sampled token's logprob and each
    top-n, batched (one gather and one topk per distinct n, not a .item() per row: on a GPU each of those was a
    sync, ~256 a step with `logprobs=0` streaming). None when no row asked. Tensors may still be on the device."""
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not want:
        return None
    lp = _rows(raw, want).float().log_softmax(-1)
    chosen = lp.gather(1, _rows(tokens.to(lp.device, torch.long), want)[:, None])[:, 0]
    tops = []
    for n in sorted({params[i].logprobs for i in want} - {0}):
        sel = [j for j, i in enumerate(want) if params[i].logprobs == n]
        vals, idx = _rows(lp, sel).topk(n, dim=-1)
        tops.append((sel, vals, idx))
    return want, chosen, tops


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] without a pageable host-to-device index copy (on CUDA that waits for the queued step, which would
    undo async scheduling's overlap); all rows (the usual case) need no copy at all."""
    if len(rows) == t.shape[0]:
        return t
    return t.index_select(0, to_device(rows, torch.long, t.device))


def logprob_entries(parts, num_rows: int, tokens: list[int] | None = None) -> list[dict | None]:
    """The host half: per row {"token_id", "logprob", "top": {id: logprob}} or None (one .tolist() per tensor).
    `parts` as logprob_tensors returns them (tensors on the host or the device); tokens: the sampled ids."""
    out: list[dict | None] = [None] * num_rows
    if parts is None:
        return out
    want, chosen, tops = parts
    chosen = chosen.tolist()
    top_of: dict[int, dict] = {}
    for sel, vals, idx in tops:
        for j, v, k in zip(sel, vals.tolist(), idx.tolist()):
            top_of[j] = dict(zip(k, v))
    for j, i in enumerate(want):
        out[i] = {"token_id": tokens[i], "logprob": chosen[j], "top": top_of.get(j, {})}
    return out
