"""Lockstep batched generation for self-distillation data, without the serving engine.

Why: `engine.generate` made 11-16k tokens/s of training text on the H200 (session 2: 748k tokens in 47 s): its
per-token host work (scheduling, detokenizing, stop checks; sampled rows drawn one by one on the host) dominates
a 135M model. Here a batch of rows decodes in lockstep over a dense KV cache: a step is one forward for all rows
plus an argmax / a device multinomial, nothing per row on the host. It also returns the target's final (post-norm)
hidden state that produced each generated token, the exact vector a speculative step hands the draft head (same
forward, dtype and norm), so no second pass over the text is needed.

On CUDA the attention is the engine's own paged Triton kernels (PagedAttention: varlen prefill, split-KV decode;
each row owns a contiguous run of blocks), so the states come from the same kernels as live decode. On a CPU
(no Triton driver) prompts are left-padded into a dense cache and attended with SDPA: row b's prompt sits at slots
[P - len_b, P) with its true RoPE positions; keys before a row's start are masked out.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F


class _DenseCtx:
    """The model's attention context: write this step's K/V at slots [s0, s0 + S), attend slots [0, s0 + S)."""

    def __init__(self, k_cache, v_cache, s0: int, S: int, start: torch.Tensor):
        self.k_cache, self.v_cache, self.s0, self.S = k_cache, v_cache, s0, S
        n = s0 + S
        key = torch.arange(n, device=start.device)
        q = s0 + torch.arange(S, device=start.device)
        # [B, 1, S, n]: a key is visible from its row's first real slot up to the query's slot (causal); a padding
        # query sees itself only (an empty row would give NaN, and NaN values poison even masked-out keys)
        k_, q_ = key[None, None, :], q[None, :, None]
        self.mask = (((k_ >= start[:, None, None]) | (k_ == q_)) & (k_ <= q_))[:, None]

    def attention(self, layer, q, k, v):
        B, S = self.mask.shape[0], self.S
        Hq, D = q.shape[1], q.shape[2]
        Hkv = k.shape[1]
        G = Hq // Hkv
        kc, vc = self.k_cache[layer], self.v_cache[layer]  # [B, Hkv, Lmax, D]
        kc[:, :, self.s0:self.s0 + S] = k.view(B, S, Hkv, D).transpose(1, 2)
        vc[:, :, self.s0:self.s0 + S] = v.view(B, S, Hkv, D).transpose(1, 2)
        n = self.s0 + S
        # grouped queries as one longer query sequence per kv head: no K/V copies for GQA
        qg = q.view(B, S, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * S, D)
        mask = self.mask.expand(B, G, S, n).reshape(B, 1, G * S, n)
        o = F.scaled_dot_product_attention(qg, kc[:, :, :n], vc[:, :, :n], attn_mask=mask)
        return o.view(B, Hkv, G, S, D).permute(0, 3, 1, 2, 4).reshape(B * S, Hq * D)


class _Paged:
    """CUDA: the kernels' PagedAttention over rows of nblk consecutive blocks; set() describes the next forward."""

    def __init__(self, model, B: int, Lmax: int, block_size: int = 16):
        from kestrel.kernels.attention.backend import PagedAttention
        cfg, w = model.config, model.embed_tokens.weight
        self.nblk, self.bs = -(-Lmax // block_size), block_size
        self.pa = PagedAttention(cfg.num_hidden_layers, B * self.nblk, block_size, cfg.num_key_value_heads,
                                 cfg.head_dim, w.dtype, w.device, cfg.head_dim ** -0.5,
                                 [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)])
        self.tables = torch.arange(B * self.nblk, dtype=torch.int32, device=w.device).view(B, self.nblk)
        self.row0 = torch.arange(B, device=w.device) * self.nblk * block_size  # slot of row b's position 0

    def prefill(self, plen: torch.Tensor):
        from kestrel.kernels.attention.backend import PagedAttentionMetadata
        rows = torch.repeat_interleave(torch.arange(len(plen), device=plen.device), plen)
        cu = torch.zeros(len(plen) + 1, dtype=torch.int32, device=plen.device)
        cu[1:] = plen.cumsum(0)
        pos = torch.arange(int(cu[-1]), device=plen.device) - cu[:-1].long()[rows]
        self.pa.set_metadata(PagedAttentionMetadata(self.row0[rows] + pos, self.tables, plen.int(), False, cu,
                                                    int(plen.max())))
        return pos, cu

    def decode(self, pos: torch.Tensor, max_len: int):
        from kestrel.kernels.attention.backend import PagedAttentionMetadata
        self.pa.set_metadata(PagedAttentionMetadata(self.row0 + pos, self.tables, (pos + 1).int(), True,
                                                    num_splits=self.pa.decode_splits(len(pos), max_len)))

    def attention(self, layer, q, k, v):
        return self.pa.attention(layer, q, k, v)


def _forward_prompts(model, prompts, dev, Lmax, paged: bool):
    """Prefill every row; returns (the hidden state at each prompt's last token [B, H], the decode context
    factory: step i -> ctx)."""
    B, plen = len(prompts), torch.tensor([len(p) for p in prompts], device=dev)
    if paged:
        ctx = _Paged(model, B, Lmax)
        pos, cu = ctx.prefill(plen)
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=dev)
        h = model(ids, pos, ctx)[cu[1:].long() - 1]

        def step(i):
            ctx.decode(plen + i, int(plen.max()) + i + 1)
            return ctx
        return h, plen, step
    cfg = model.config
    P = int(plen.max())
    dt = model.embed_tokens.weight.dtype
    kc = [torch.zeros(B, cfg.num_key_value_heads, Lmax, cfg.head_dim, dtype=dt, device=dev)
          for _ in range(cfg.num_hidden_layers)]
    vc = [torch.zeros_like(c) for c in kc]
    start = P - plen
    ids = torch.zeros(B, P, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
    pos = (torch.arange(P, device=dev)[None, :] - start[:, None]).clamp(min=0)
    h = model(ids.reshape(-1), pos.reshape(-1), _DenseCtx(kc, vc, 0, P, start)).view(B, P, -1)[:, -1]
    return h, plen, lambda i: _DenseCtx(kc, vc, P + i, 1, start)


@torch.inference_mode()
def generate_batch(model, prompts: list[list[int]], max_tokens: int, temperature: torch.Tensor | float = 0.0,
                   eos_ids=(), sample_steps: int | None = None, generator: torch.Generator | None = None,
                   want_hidden: bool = True, paged: bool | None = None):
    """Greedy (temperature 0) or sampled continuations of a batch of prompts, in lockstep.
    temperature: per row [B] or one value; sampled rows draw only in the first `sample_steps` steps (None = all),
    then continue greedily. A row stops after an eos id (kept) or max_tokens.
    Returns (outputs: list of token lists, hidden: list of [len(output), H] tensors, hidden[b][i] = the state that
    produced outputs[b][i]; None when want_hidden is False). paged: the Triton paged kernels (default: on CUDA)."""
    dev = model.embed_tokens.weight.device
    B = len(prompts)
    Lmax = max(len(p) for p in prompts) + max_tokens
    paged = dev.type == "cuda" if paged is None else paged
    h, plen, ctx_at = _forward_prompts(model, prompts, dev, Lmax, paged)
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=dev).expand(B)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=dev)
    toks, hids = [], []
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    n_out = torch.zeros(B, dtype=torch.long, device=dev)
    for i in range(max_tokens):
        logits = model.compute_logits(h).float()
        nxt = logits.argmax(-1)
        t = temp if sample_steps is None or i < sample_steps else torch.zeros_like(temp)
        if bool((t > 0).any()):
            probs = torch.softmax(logits / t.clamp(min=1e-6)[:, None], -1)
            drawn = torch.multinomial(probs, 1, generator=generator)[:, 0]
            nxt = torch.where(t > 0, drawn, nxt)
        toks.append(nxt)
        if want_hidden:
            hids.append(h)
        n_out += (~done).long()
        done |= torch.isin(nxt, eos)
        if i == max_tokens - 1 or bool(done.all()):
            break
        h = model(nxt, plen + i, ctx_at(i))
    T = torch.stack(toks, 1).tolist()
    n = n_out.tolist()
    outs = [T[b][:n[b]] for b in range(B)]
    if not want_hidden:
        return outs, None
    Hs = torch.stack(hids, 1)
    return outs, [Hs[b, :n[b]] for b in range(B)]


def generate(model, prompts: list[list[int]], max_tokens: int, batch_size: int = 256, temperatures=None,
             deadline: float | None = None, log: bool = False, **kw):
    """generate_batch over the prompts in batches of batch_size (sorted by length: less padding, similar lengths).
    temperatures: one per prompt (default greedy). deadline (time.monotonic()): no new batch starts after it, the
    prompts left get None. Returns outputs and hidden lists in the order of `prompts`."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    temps = temperatures if temperatures is not None else [0.0] * len(prompts)
    outs, hid = [None] * len(prompts), [None] * len(prompts)
    t0 = time.monotonic()
    for c in range(0, len(order), batch_size):
        if deadline is not None and time.monotonic() > deadline:
            print(f"static generation: time box reached after {c} of {len(order)} prompts", flush=True)
            break
        idx = order[c:c + batch_size]
        t1 = time.monotonic()
        o, h = generate_batch(model, [prompts[i] for i in idx], max_tokens,
                              torch.tensor([float(temps[i]) for i in idx]), **kw)
        for j, i in enumerate(idx):
            outs[i] = o[j]
            hid[i] = h[j] if h is not None else None
        if log:
            n = sum(map(len, o))
            print(f"static generation: batch of {len(idx)} rows, {n} tokens in {time.monotonic() - t1:.2f}s "
                  f"({n / max(time.monotonic() - t1, 1e-9):.0f} tok/s; {time.monotonic() - t0:.1f}s so far)", flush=True)
    return outs, hid
