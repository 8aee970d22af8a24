"""Self-distillation of the draft head: the target generates text, then the head learns to predict the target's
own next-k-token distributions from the target's hidden states on that text.

Only the target's final hidden states are stored: the teacher's logits at any position are exactly
hidden @ lm_head^T, so they are recomputed for the sampled positions of each step (no [T, V] logit tensors kept).
"""
from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kestrel.spec.draft_head import DraftHead


class _CausalCtx:
    """Stand-in for the engine's attention context: plain causal attention over one whole sequence (no cache)."""

    def attention(self, layer_idx, q, k, v):
        T, nh, hd = q.shape
        rep = nh // k.shape[1]
        k, v = (t.repeat_interleave(rep, dim=1) for t in (k, v))
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        return o.transpose(0, 1).reshape(T, nh * hd)


@torch.inference_mode()
def collect_hidden(model, seqs: list[list[int]], device, progress: bool = True) -> list[torch.Tensor]:
    """Final (post-norm) hidden states [T, H] of a kestrel LlamaForCausalLM on each full sequence."""
    ctx = _CausalCtx()
    out = []
    for s in tqdm(seqs, desc="Target hidden states", unit="seq", disable=not progress):
        ids = torch.tensor(s, device=device)
        out.append(model(ids, torch.arange(len(s), device=device), ctx).float())
    return out


def _sample_batch(hidden, seqs, k, n, gen: random.Random, device):
    """n random (sequence, t) positions with t + 2 < len: inputs h_t, x_{t+1}; per slot i the previous token
    x_{t+1+i}, the teacher hidden at t+1+i (its logits predict x_{t+2+i}), the token x_{t+2+i} the target actually
    generated there, and a validity mask."""
    hs, nxt, prev, teach, label, mask = [], [], [], [], [], []
    for _ in range(n):
        j = gen.randrange(len(seqs))
        L = len(seqs[j])
        t = gen.randrange(L - 2)
        hs.append(hidden[j][t])
        nxt.append(seqs[j][t + 1])
        idx = [min(t + 1 + i, L - 2) for i in range(k)]
        prev.append([seqs[j][p] for p in idx])
        label.append([seqs[j][p + 1] for p in idx])
        teach.append(hidden[j][idx])
        mask.append([t + 2 + i <= L - 1 for i in range(k)])
    f = lambda x: torch.tensor(x, device=device)
    return torch.stack(hs).to(device), f(nxt), f(prev), torch.stack(teach).to(device), f(label), f(mask)


def train_head(embed: torch.Tensor, lm_head: torch.Tensor, hidden: list[torch.Tensor], seqs: list[list[int]],
               k: int = 4, steps: int = 500, batch_positions: int = 256, lr: float = 1e-3, seed: int = 0,
               head: DraftHead | None = None, progress: bool = True, conf_weight: float = 0.5,
               vocab_subset: bool = False) -> DraftHead:
    """Distil: cross-entropy to the teacher's distribution at each slot (soft) and to the token the teacher actually
    generated there (hard: a sharp signal even where the teacher is flat), + BCE of the confidence output against
    'the head's argmax equals the teacher's argmax' (per-slot acceptance under greedy verification).

    vocab_subset: score only the tokens that occur in the training text (teacher and head alike). On a CPU this cuts
    the dominant [positions, vocab] matmuls by the vocabulary/subset ratio (~10x for SmolLM2); at inference the head
    still reads out over the full vocabulary."""
    device = embed.device
    torch.manual_seed(seed)
    gen = random.Random(seed)
    keep = [j for j, s in enumerate(seqs) if len(s) >= 3]
    seqs, hidden = [seqs[j] for j in keep], [hidden[j] for j in keep]
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
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    warm = max(1, steps // 20)
    cosine = lambda i: min(1.0, (i + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: max(cosine(i), 0.05))
    bar = tqdm(range(steps), desc="Training draft head", unit="step", disable=not progress)
    stats = {}
    for step in bar:
        h, nxt, prev, teach, label, mask = _sample_batch(hidden, seqs, head.k, batch_positions, gen, device)
        if remap is not None:
            label = remap[label]
        logits, conf = head.forward_teacher(h, embed[nxt], embed[prev], lm_head)
        with torch.no_grad():
            t_logits = teach @ lm_head.t()
            t_prob = torch.softmax(t_logits, -1)
            hit = (logits.argmax(-1) == t_logits.argmax(-1)).float()
        m = mask.float()
        logp = torch.log_softmax(logits, -1)
        ce = -(t_prob * logp).sum(-1) - logp.gather(-1, label[..., None]).squeeze(-1)
        bce = F.binary_cross_entropy_with_logits(conf, hit, reduction="none")
        loss = ((ce + conf_weight * bce) * m).sum() / m.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 10 == 0 or step == steps - 1:
            acc = (hit * m).sum(0) / m.sum(0).clamp_min(1)
            stats = {"loss": round(loss.item(), 3), "acc1": round(acc[0].item(), 3), f"acc{head.k}": round(acc[-1].item(), 3)}
            bar.set_postfix(stats)
    head.train_stats = stats
    return head.eval()
