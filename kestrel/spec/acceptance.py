"""Greedy acceptance of a draft head on target-generated text, per slot, without timing.

At a generated position t the head gets what a speculative step hands it (the target's hidden state h_t and the
token x_{t+1} it produced) and proposes k tokens; under greedy verification draft i is accepted iff it and every
earlier draft equal the target's own next tokens x_{t+2..t+i+1}. Shared by `kestrel train-draft` (its held-out
split) and bench/draft_acceptance.py (held-out workloads), so both report the same numbers.
"""
from __future__ import annotations

import torch


def match_prefix(draft: torch.Tensor, truth: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[N, k] drafts vs true next tokens (valid: the true token exists) -> accepted prefix length [N]."""
    return ((draft == truth) & valid).long().cumprod(1).sum(1)


def draft_positions(seq_len: int, prompt_len: int, device=None) -> torch.Tensor:
    """Positions t whose draft can be scored: h_t produced a generated token x_{t+1} (t >= prompt_len - 1) and the
    first drafted token x_{t+2} exists."""
    return torch.arange(max(prompt_len - 1, 0), seq_len - 2, device=device)


@torch.inference_mode()
def head_prefixes(head, seqs, prompt_lens, hidden, embed: torch.Tensor, lm_head: torch.Tensor, k: int,
                  max_rows: int = 8192, hidden_offsets=None, readout=None) -> torch.Tensor:
    """Accepted prefix length of the head's greedy drafts at every scorable position of every sequence. The head
    runs in embed's dtype and device, as HeadDrafter runs it in the engine. hidden[j] starts at position
    hidden_offsets[j] (default 0)."""
    dev = embed.device
    out = []
    offs = hidden_offsets if hidden_offsets is not None else [0] * len(seqs)
    for s, p, h, o in zip(seqs, prompt_lens, hidden, offs):
        L = len(s)
        t = draft_positions(L, max(p, o + 1), dev)
        if not len(t):
            continue
        toks = torch.tensor(s, device=dev)
        idx = t[:, None] + 2 + torch.arange(k, device=dev)[None, :]
        for c in range(0, len(t), max_rows):
            tc, ic = t[c:c + max_rows], idx[c:c + max_rows]
            ctx = head.context_window(h.to(dev, embed.dtype), tc, head.context, o) if getattr(head, "context", 0) else ()
            d, _ = head.draft_greedy(h[tc - o].to(dev, embed.dtype), toks[tc + 1], embed, lm_head, k, want_conf=False,
                                     readout=readout, **dict(zip(("ctx", "ctx_valid"), ctx)))
            out.append(match_prefix(d, toks[ic.clamp(max=L - 1)], ic < L).cpu())
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def walk_tokens_per_verify(pref: torch.Tensor, counts: list[int], k: int) -> list[float]:
    """Tokens per verify as the speculative loop meets them, at fixed k = 1..k: walk each sequence from its first
    draft position, step over the accepted prefix + the target's token, and count tokens / steps. The per-position
    mean (slot_stats' tokens_per_verify) weighs every position once, but the loop spends few steps where drafts are
    long and many where they fail, so it sees less (session 4 R1: 2.09 per position offline vs 1.79 live).
    pref: head_prefixes' flat output, counts: its positions per sequence (in order; greedy drafts of k = j are the
    first j of the k-draft, so prefix at j = min(prefix, j))."""
    segs = [s.tolist() for s in pref.split(list(counts))]
    out = []
    for j in range(1, k + 1):
        tok = steps = 0
        for s in segs:
            t = 0
            while t < len(s):
                a = min(s[t], j)
                tok, steps, t = tok + a + 1, steps + 1, t + a + 1
        out.append(tok / max(steps, 1))
    return out


def slot_stats(pref: torch.Tensor, k: int, counts: list[int] | None = None) -> dict:
    """Per slot i: P(accept i | accepted < i) (cond), P(prefix >= i) (reach); tokens per verify at fixed k = j
    (accepted prefix + the target's own token); with counts (positions per sequence) also `walk`
    (walk_tokens_per_verify: what a live loop would see)."""
    reach = [(pref >= i).float().mean().item() if pref.numel() else 0.0 for i in range(k + 1)]
    cond = [reach[i] / reach[i - 1] if reach[i - 1] > 0 else 0.0 for i in range(1, k + 1)]
    st = {"positions": pref.numel(), "cond": cond, "reach": reach[1:],
          "tokens_per_verify": [1 + sum(reach[1:j + 1]) for j in range(1, k + 1)]}
    if counts is not None:
        st["walk"] = walk_tokens_per_verify(pref, counts, k)
    return st


def format_stats(name: str, st: dict) -> str:
    """One markdown table row (columns as in table_header; the walk columns only where st has them)."""
    f = lambda xs, d: " | ".join(f"{x:.{d}f}" for x in xs)
    row = f"| {name} | {st['positions']} | {f(st['cond'], 3)} | {f(st['reach'], 3)} | {f(st['tokens_per_verify'], 2)} |"
    return row + (f" {f(st['walk'], 2)} |" if "walk" in st else "")


def table_header(k: int, walk: bool = False) -> list[str]:
    hdr = ("| drafter | positions | " + " | ".join(f"P(acc {i} \\| <{i})" for i in range(1, k + 1)) + " | "
           + " | ".join(f"P(prefix>={i})" for i in range(1, k + 1)) + " | "
           + " | ".join(f"tokens/verify k={j}" for j in range(1, k + 1)) + " |")
    if walk:
        hdr += " " + " | ".join(f"walk tok/verify k={j}" for j in range(1, k + 1)) + " |"
    return [hdr, "|---" * (2 + (4 if walk else 3) * k) + "|"]
