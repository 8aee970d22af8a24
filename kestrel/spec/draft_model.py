"""Small-draft-model drafter: any causal LM, given as a callable from a batch of token lists to next-token logits,
proposes k tokens autoregressively. Confidence = the draft's own probability of its token."""
from __future__ import annotations

from typing import Callable

import torch

from kestrel.spec.drafter import Draft, DraftInput, Drafter

LogitsFn = Callable[[list[list[int]]], torch.Tensor]  # token lists -> [B, V] logits for the next token


class DraftModelDrafter(Drafter):
    def __init__(self, logits_fn: LogitsFn, generator: torch.Generator | None = None):
        self.logits_fn = logits_fn
        self.generator = generator

    def propose(self, inputs: list[DraftInput], k: int) -> Draft:
        B = len(inputs)
        if k == 0 or B == 0:
            return Draft.empty(B)
        ctx = [list(i.token_ids) for i in inputs]
        temp = torch.tensor([i.temperature for i in inputs])
        sample = temp > 0
        toks, conf, probs = [], [], []
        for _ in range(k):
            logits = self.logits_fn(ctx).float().cpu()
            q = torch.softmax(logits / temp.clamp_min(1e-5)[:, None], dim=-1)
            greedy_tok = logits.argmax(-1)
            tok = greedy_tok.clone()
            if sample.any():
                tok[sample] = torch.multinomial(q[sample], 1, generator=self.generator).squeeze(1)
            # greedy rows: confidence = top-1 prob of the untempered draft distribution
            p1 = torch.softmax(logits, -1).gather(1, tok[:, None]).squeeze(1)
            conf.append(torch.where(sample, q.gather(1, tok[:, None]).squeeze(1).clamp(max=1.0), p1))
            toks.append(tok)
            probs.append(q)
            for c, t in zip(ctx, tok.tolist()):
                c.append(t)
        return Draft(torch.stack(toks, 1), torch.full((B,), k, dtype=torch.long), torch.stack(conf, 1),
                     torch.stack(probs, 1) if sample.any() else None)


def hf_logits_fn(model, device="cpu") -> LogitsFn:
    """Adapter for a transformers causal LM: right-aligned batch (left padding) with an attention mask."""
    @torch.inference_mode()
    def fn(batch: list[list[int]]) -> torch.Tensor:
        L = max(len(t) for t in batch)
        ids = torch.zeros(len(batch), L, dtype=torch.long)
        mask = torch.zeros(len(batch), L, dtype=torch.long)
        for b, t in enumerate(batch):
            ids[b, L - len(t):] = torch.tensor(t)
            mask[b, L - len(t):] = 1
        pos = (mask.cumsum(1) - 1).clamp_min(0)
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device))
        return out.logits[:, -1]
    return fn
