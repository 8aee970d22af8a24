"""SWA bounded replay: resume a prefix-cached request without storing full-length sliding-window KV.

For a model whose layers are full attention or sliding-window attention (SWA, window W), a sequence's state
after P tokens is: full-attention K/V of all P tokens (prefix-cacheable, shared between requests) plus, for
each SWA layer, the K/V of its last W-1 tokens only (older keys are never read again). So SWA layers keep a
bounded per-sequence window and are left out of the prefix cache. When a request resumes from a cached prefix
of length P, the SWA windows are rebuilt by replaying the prefix's last R tokens: full layers attend with their
cached K/V (never rewritten), SWA layers recompute K/V from the replayed hidden states.

Exactness: a SWA layer's output at position t reads keys [t-W+1, t], so every SWA layer in the stack pushes
the dependency W-1 tokens further back, while full layers (cached K/V) add nothing. Replaying
R = num_swa_layers * (W-1) tokens therefore reproduces the windows bit-for-bit up to float reassociation
(`exact_replay_tokens`). With a single SWA layer that is W-1 <= window tokens; DeepInfer replays just
`window` tokens for every model and accepts the drift; pass `replay_tokens` to do the same.

This module is the reference implementation on dense per-sequence tensors (CPU or GPU, PyTorch SDPA). It
drives any model with the `forward(input_ids, positions, ctx)` / `ctx.attention(layer, q, k, v)` interface.
The paged engine's version (own SWA block pool, replay on a prefix-cache hit) is kestrel/engine/swa_kv.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def exact_replay_tokens(window: int, num_swa_layers: int) -> int:
    """Replay length that rebuilds every SWA layer's window exactly (see module docstring)."""
    if window < 1:
        raise ValueError("window must be >= 1")
    return num_swa_layers * (window - 1)


@dataclass
class SequenceKV:
    """One sequence's KV state: full layers hold every position from 0; SWA layers hold a bounded tail."""
    window: int
    full: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # layer -> K, V [P, Hkv, D]
    swa: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # layer -> K, V [<=W-1, ...]
    swa_start: dict[int, int] = field(default_factory=dict)  # layer -> position of swa[layer][0][0]

    def swa_tokens(self) -> int:
        return max((k.shape[0] for k, _ in self.swa.values()), default=0)


def _attend(q, k, v, q_pos, k_pos, window: int | None):
    vis = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        vis &= q_pos[:, None] - k_pos[None, :] < window
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=vis,
                                       enable_gqa=True)
    return o.transpose(0, 1).reshape(q.shape[0], -1)


class _ReplayCtx:
    def __init__(self, kv: SequenceKV, swa_layers: set[int], start: int, n: int, device):
        self.kv, self.swa_layers, self.start = kv, swa_layers, start
        self.pos = torch.arange(start, start + n, device=device)

    def attention(self, layer, q, k, v):
        kv, start = self.kv, self.start
        if layer in self.swa_layers:
            # keys: the kept tail (positions swa_start..start-1) + this call's fresh keys
            if layer in kv.swa:
                k0, v0 = kv.swa[layer]
                k, v = torch.cat([k0, k]), torch.cat([v0, v])
                first = kv.swa_start[layer]
            else:
                first = start
            k_pos = torch.arange(first, first + k.shape[0], device=q.device)
            out = _attend(q, k, v, self.pos, k_pos, kv.window)
            keep = min(kv.window - 1, k.shape[0])  # the only keys any later query can read
            kv.swa[layer] = (k[k.shape[0] - keep:].clone(), v[v.shape[0] - keep:].clone())
            kv.swa_start[layer] = first + k.shape[0] - keep
            return out
        # full layer: cached positions keep their stored K/V (replayed tokens never rewrite them)
        k0, v0 = kv.full.get(layer, (k[:0], v[:0]))
        cached = k0.shape[0]
        if start > cached:
            raise ValueError(f"layer {layer}: tokens from {start} but only {cached} cached")
        k = torch.cat([k0, k[cached - start:]])
        v = torch.cat([v0, v[cached - start:]])
        kv.full[layer] = (k, v)
        return _attend(q, k, v, self.pos, torch.arange(k.shape[0], device=q.device), None)


@torch.inference_mode()
def run_tokens(model, token_ids: torch.Tensor, start: int, kv: SequenceKV, swa_layers: set[int]) -> torch.Tensor:
    """Feed tokens at positions [start, start+len) through the model on state `kv`; returns logits [len, vocab]."""
    ctx = _ReplayCtx(kv, swa_layers, start, token_ids.shape[0], token_ids.device)
    return model.compute_logits(model(token_ids, ctx.pos, ctx))


def prefill(model, token_ids: torch.Tensor, window: int, swa_layers: set[int]) -> tuple[torch.Tensor, SequenceKV]:
    """Cold prefill from position 0."""
    kv = SequenceKV(window)
    return run_tokens(model, token_ids, 0, kv, swa_layers), kv


def resume(model, token_ids: torch.Tensor, prefix_len: int, cached_full: dict[int, tuple[torch.Tensor, torch.Tensor]],
           window: int, swa_layers: set[int], replay_tokens: int | None = None) -> tuple[torch.Tensor, SequenceKV]:
    """Resume a request whose first `prefix_len` tokens hit the prefix cache; `cached_full` holds the
    full-attention layers' K/V of at least those tokens (an all-SWA model has none). Replays the prefix's last
    `replay_tokens` (default: exact_replay_tokens) through the model, then runs the rest of `token_ids`.
    Returns the logits of the tokens after the prefix, [len(token_ids) - prefix_len, vocab], and the new state."""
    P = prefix_len
    if not 0 <= P < token_ids.shape[0]:
        raise ValueError("the cached prefix must be shorter than the request (at least one token to compute)")
    full_layers = [i for i in range(len(model.layers)) if i not in swa_layers]
    for i in full_layers:
        if i not in cached_full or cached_full[i][0].shape[0] < P:
            raise ValueError(f"cached_full lacks {P} tokens of K/V for full-attention layer {i}")
    R = exact_replay_tokens(window, len(swa_layers)) if replay_tokens is None else replay_tokens
    S = max(0, P - R)
    kv = SequenceKV(window, full={i: (cached_full[i][0][:P].clone(), cached_full[i][1][:P].clone())
                                  for i in full_layers})
    logits = run_tokens(model, token_ids[S:], S, kv, swa_layers)
    return logits[P - S:], kv
