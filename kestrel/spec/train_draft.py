"""Self-distillation of the draft head: the target generates text, then the head learns to predict the target's
own next-k-token distributions from the target's hidden states on that text.

Only the target's final hidden states are stored: the teacher's logits at any position are exactly
hidden @ lm_head^T, so they are recomputed for the sampled positions of each step (no [T, V] logit tensors kept).
"""
from __future__ import annotations

import itertools
import math
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kestrel.spec.draft_head import DraftHead


class _CausalCtx:
    """Stand-in for the engine's attention context (no cache): causal attention over one sequence, or, given lens,
    over several sequences back to back with none across them (block-diagonal mask). Packing gives one forward per
    ~max_tokens instead of one per sequence: per-sequence forwards are launch-bound on a GPU."""

    def __init__(self, lens: list[int] | None = None, device=None):
        self.mask = None
        if lens is not None and len(lens) > 1:
            seg = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
            pos = torch.arange(len(seg), device=device)
            self.mask = (seg[:, None] == seg[None, :]) & (pos[:, None] >= pos[None, :])

    def attention(self, layer_idx, q, k, v):
        T, nh, hd = q.shape
        rep = nh // k.shape[1]
        k, v = (t.repeat_interleave(rep, dim=1) for t in (k, v))
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=self.mask, is_causal=self.mask is None)
        return o.transpose(0, 1).reshape(T, nh * hd)


@torch.inference_mode()
def collect_hidden(model, seqs: list[list[int]], device, progress: bool = True, max_tokens: int = 1,
                   dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Final (post-norm) hidden states [T, H] of a kestrel LlamaForCausalLM on each full sequence. max_tokens > 1
    packs sequences into forwards of up to that many tokens (same states: attention never crosses sequences)."""
    out: list[torch.Tensor] = []
    bar = tqdm(total=len(seqs), desc="Target hidden states", unit="seq", disable=not progress)
    i = 0
    while i < len(seqs):
        j, n = i + 1, len(seqs[i])
        while j < len(seqs) and n + len(seqs[j]) <= max_tokens:
            n += len(seqs[j])
            j += 1
        group = seqs[i:j]
        ids = torch.tensor([t for s in group for t in s], device=device)
        pos = torch.cat([torch.arange(len(s), device=device) for s in group])
        ctx = _CausalCtx([len(s) for s in group], device)
        h = model(ids, pos, ctx).to(dtype)
        out.extend(h.split([len(s) for s in group]))
        bar.update(j - i)
        i = j
    bar.close()
    return out


class _Packed:
    """All sequences' tokens and hidden states in flat device tensors, so a batch is a few gathers (a per-position
    Python loop made each step launch hundreds of tiny copies on a GPU). hidden[j] covers positions
    [hidden_offsets[j], ...) of sequence j (0 = all of it, as collect_hidden returns; static_generate returns only
    the generated part). `pos` lists the trainable positions t (token index, their sequence in `pos_seq`): with
    prompt lengths only t >= prompt_len - 1, where h_t produced a generated token x_{t+1}, as at inference (the head
    never drafts inside a prompt; the chat template's fixed system prompt there is trivially predictable and
    inflated the training accuracy)."""

    def __init__(self, hidden, seqs, device, prompt_lens=None, hidden_offsets=None):
        self.h = torch.cat([h.to(device) for h in hidden])  # kept in the collected dtype (bf16 halves 1M+ tokens)
        self.tok = torch.tensor([t for s in seqs for t in s], device=device)
        lens = torch.tensor([len(s) for s in seqs])
        hlen = torch.tensor([len(h) for h in hidden])
        hoff = torch.zeros_like(lens) if hidden_offsets is None else torch.tensor(hidden_offsets)
        if bool((hoff + hlen < lens - 1).any()):
            raise ValueError("hidden states must cover every position up to the second-to-last token")
        start, hstart = lens.cumsum(0) - lens, hlen.cumsum(0) - hlen
        lo = torch.zeros_like(lens) if prompt_lens is None else (torch.tensor(prompt_lens) - 1).clamp(min=0)
        lo = torch.maximum(lo, hoff)
        cnt = (lens - 2 - lo).clamp(min=0)  # t in [lo, L - 3]: x_{t+2} exists
        if int(cnt.sum()) == 0:
            raise ValueError("train-draft needs generated sequences with at least 2 tokens past the prompt")
        seq_of = torch.repeat_interleave(torch.arange(len(lens)), cnt)
        off = torch.arange(int(cnt.sum())) - torch.repeat_interleave(cnt.cumsum(0) - cnt, cnt)
        self.pos = (lo[seq_of] + off).to(device)
        self.pos_seq = seq_of.to(device)
        self.lens, self.start = lens.to(device), start.to(device)
        self.hbase = (hstart - hoff).to(device)  # flat hidden index of position q of sequence j: hbase[j] + q
        self.hoff = hoff.to(device)  # first position with a hidden state (context windows stop there)


def _sample_batch(p: _Packed, k, n, gen: torch.Generator, device, context: int = 0):
    """n random trainable positions t: inputs h_t, x_{t+1}; per slot i the previous token x_{t+1+i}, the teacher
    hidden at t+1+i (its logits predict x_{t+2+i}), the token x_{t+2+i} the target actually generated there, and a
    validity mask; with context = W > 0 also h_{t-W+1} .. h_t [n, W, H] and their validity [n, W] (positions
    before the first collected hidden state are masked)."""
    r = torch.randint(len(p.pos), (n,), generator=gen).to(device)
    t, j = p.pos[r], p.pos_seq[r]
    L, base, hb = p.lens[j], p.start[j], p.hbase[j]
    i = torch.arange(k, device=device)[None, :]
    idx = torch.minimum(t[:, None] + 1 + i, (L - 2)[:, None])
    mask = t[:, None] + 2 + i <= (L - 1)[:, None]
    out = (p.h[hb + t].float(), p.tok[base + t + 1], p.tok[base[:, None] + idx], p.h[hb[:, None] + idx].float(),
           p.tok[base[:, None] + idx + 1], mask)
    if not context:
        return out
    pos = t[:, None] - torch.arange(context - 1, -1, -1, device=device)[None, :]
    valid = pos >= p.hoff[j][:, None]
    return out + (p.h[hb[:, None] + torch.maximum(pos, p.hoff[j][:, None])].float(), valid)


def train_head(embed: torch.Tensor, lm_head: torch.Tensor, hidden: list[torch.Tensor], seqs: list[list[int]],
               k: int = 4, steps: int | None = 500, batch_positions: int = 256, lr: float = 1e-3, seed: int = 0,
               head: DraftHead | None = None, progress: bool = True, conf_weight: float = 0.5,
               vocab_subset: bool = False, max_seconds: float | None = None, hard_label: str = "argmax",
               log_every: int = 0, prompt_lens: list[int] | None = None, weight_decay: float = 0.0,
               amp: bool = False, hidden_offsets: list[int] | None = None, checkpoint=None,
               checkpoint_every: float = 0.0) -> DraftHead:
    """Distil: cross-entropy to the teacher's distribution at each slot (soft) and to the token the teacher actually
    generated there (hard: a sharp signal even where the teacher is flat), + BCE of the confidence output against
    'the head's argmax equals the teacher's argmax' (per-slot acceptance under greedy verification).

    vocab_subset: score only the tokens that occur in the training text (teacher and head alike). On a CPU this cuts
    the dominant [positions, vocab] matmuls by the vocabulary/subset ratio (~10x for SmolLM2); at inference the head
    still reads out over the full vocabulary.

    max_seconds: a wall-clock budget; the learning-rate schedule then runs on max(step / steps, elapsed / budget),
    so a run cut short by the clock still ends annealed. steps=None: no step limit, the clock alone (needs it).

    hard_label: "argmax" = the teacher's most likely token (what greedy verification accepts), "generated" = the
    token the target sampled there (different from the argmax wherever the data was generated with temperature).
    With greedy-generated data, teacher forcing on the true previous tokens is exactly the head's situation at
    inference whenever the earlier drafts were accepted (the only case in which a later draft can count).
    log_every: print the running stats every so many steps (for logs without a progress bar).
    prompt_lens: train only where the head drafts at inference, past each prompt (see _Packed); None = everywhere.
    hidden_offsets: the first position each hidden[j] covers (None = 0: full sequences).
    checkpoint(head, stats): called every checkpoint_every seconds of training with the head in eval mode (then
    back to train): a job cut by its time limit keeps the latest head.
    amp: bf16 autocast for the [positions, vocab] readouts (CUDA; the softmax / losses stay float32)."""
    device = embed.device
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    keep = [j for j, s in enumerate(seqs) if len(s) >= 3]
    seqs, hidden = [seqs[j] for j in keep], [hidden[j] for j in keep]
    prompt_lens = None if prompt_lens is None else [prompt_lens[j] for j in keep]
    hidden_offsets = None if hidden_offsets is None else [hidden_offsets[j] for j in keep]
    if not seqs:
        raise ValueError("train-draft needs sequences of at least 3 tokens")
    head = head or DraftHead(embed.shape[1], k=k)
    head = head.to(device).train()
    embed, lm_head = embed.detach().float(), lm_head.detach().float()
    remap = None
    if vocab_subset:
        sub = torch.tensor(sorted({t for s in seqs for t in s}), device=device)
        remap = torch.full((lm_head.shape[0],), -1, dtype=torch.long, device=device)
        remap[sub] = torch.arange(len(sub), device=device)
        lm_head = lm_head[sub]
    packed = _Packed(hidden, seqs, device, prompt_lens, hidden_offsets)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp and device.type == "cuda")
    t0 = time.monotonic()

    if steps is None and not max_seconds:
        raise ValueError("train_head: steps=None (train on the clock) needs max_seconds")

    by_steps = lambda i: i / steps if steps else 0.0  # (steps=None: the clock alone measures progress)

    def frac(i):  # training progress in [0, 1]: by steps, or by the clock when that is further along
        f = by_steps(i)
        return min(1.0, max(f, (time.monotonic() - t0) / max_seconds)) if max_seconds else min(f, 1.0)
    # linear warm-up over the first 5% of training, then cosine
    cosine = lambda i: min(1.0, max(frac(i), by_steps(i + 1)) / 0.05) * 0.5 * (1 + math.cos(math.pi * frac(i)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: max(cosine(i), 0.05))
    bar = tqdm(range(steps) if steps else itertools.count(), total=steps, desc="Training draft head", unit="step",
               disable=not progress)
    stats, done, last_ckpt = {}, 0, time.monotonic()
    for step in bar:
        if max_seconds and time.monotonic() - t0 >= max_seconds:
            break
        h, nxt, prev, teach, label, mask, *ctx = _sample_batch(packed, head.k, batch_positions, gen, device,
                                                                getattr(head, "context", 0))
        if remap is not None:
            label = remap[label]
        with autocast:
            logits, conf = head.forward_teacher(h, embed[nxt], embed[prev], lm_head, *ctx)
        with torch.no_grad():  # the teacher in float32: bf16 logits would tie near-equal tokens (argmax labels)
            t_logits = teach @ lm_head.t()
            t_prob = torch.softmax(t_logits, -1)
            t_top = t_logits.argmax(-1)
            hit = (logits.argmax(-1) == t_top).float()
            if hard_label == "argmax":
                label = t_top
        m = mask.float()
        logp = torch.log_softmax(logits.float(), -1)
        ce = -(t_prob * logp).sum(-1) - logp.gather(-1, label[..., None]).squeeze(-1)
        bce = F.binary_cross_entropy_with_logits(conf.float(), hit, reduction="none")
        loss = ((ce + conf_weight * bce) * m).sum() / m.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        sched.step()
        done = step + 1
        if step % 10 == 0 or step == (steps or 0) - 1:
            acc = (hit * m).sum(0) / m.sum(0).clamp_min(1)
            stats = {"loss": round(loss.item(), 3), "acc1": round(acc[0].item(), 3), f"acc{head.k}": round(acc[-1].item(), 3)}
            bar.set_postfix(stats)
            if log_every and step % log_every == 0:
                print(f"step {step} {time.monotonic() - t0:.0f}s {stats}", flush=True)
        if checkpoint is not None and checkpoint_every and time.monotonic() - last_ckpt >= checkpoint_every:
            head.train_stats = dict(stats, steps=done)
            checkpoint(head.eval(), head.train_stats)
            head.train()
            last_ckpt = time.monotonic()
    head.train_stats = dict(stats, steps=done)
    return head.eval()
