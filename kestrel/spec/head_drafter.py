"""Drafter backed by a trained DraftHead: needs the target's last hidden state per request (the engine passes it)."""
from __future__ import annotations

import torch

from kestrel.spec.draft_head import DraftHead
from kestrel.spec.drafter import Draft, DraftInput, Drafter


class HeadDrafter(Drafter):
    needs_hidden = True

    def __init__(self, head: DraftHead, embed: torch.Tensor, lm_head: torch.Tensor,
                 generator: torch.Generator | None = None, fused: bool | None = None):
        if head.cfg["hidden_size"] != embed.shape[1]:
            raise ValueError(f"draft head hidden size {head.cfg['hidden_size']} does not match the target's "
                             f"{embed.shape[1]}: it was trained for another model")
        self.head = head.to(device=embed.device, dtype=embed.dtype).eval()
        self.embed, self.lm_head = embed, lm_head
        self.generator = generator
        self.graphs = None  # HeadGraphs (head_graphs.py): greedy proposals replayed from CUDA graphs
        # greedy drafting's readout over the head's draft vocabulary (None: the full vocabulary); KESTREL_HEAD_VOCAB=0
        # turns it off (A/B of its cost)
        import os
        self.readout = head.subset_readout(embed, lm_head) if os.environ.get("KESTREL_HEAD_VOCAB", "1") != "0" \
            else None
        # fused drafting (CUDA): refine + readout of each slot in 3 Triton kernels instead of ~9 launches
        # (head_fused.py; R1 of session 5: k=4 proposal 0.124 -> 0.077 ms at batch 1). On by default since session 7
        # R1: against a float32 reference its drafts are at least as close as the PyTorch bf16 ones at batch 1 / 64
        # / 256 (bench/spec_head_cost.py: whole chain 1.000 / 0.984 / 0.949 vs 1.000 / 0.891 / 0.910) and the live
        # loop ran 1.321 vs 1.361 ms per K=4 step at the same tokens/verify. fused: True / False, None = the
        # KESTREL_HEAD_FUSED environment variable (0 turns it off)
        if fused is None:
            fused = os.environ.get("KESTREL_HEAD_FUSED", "1") != "0"
        if self.readout is not None and embed.is_cuda and fused:
            from kestrel.spec.head_fused import FusedGreedyDraft
            self.readout = FusedGreedyDraft(self.head, embed, lm_head, self.readout)

    def enable_cuda_graphs(self, batch_sizes: list[int]) -> None:
        from kestrel.spec.head_graphs import HeadGraphs

        self.graphs = HeadGraphs(self.head, self.embed, self.lm_head, batch_sizes, self.readout)
        self.graphs.capture()

    @torch.inference_mode()
    def propose(self, inputs: list[DraftInput], k: int) -> Draft:
        B = len(inputs)
        have = [b for b, i in enumerate(inputs) if i.hidden is not None]
        k = min(k, self.head.k)
        if k == 0 or not have:
            return Draft.empty(B)
        dev = self.embed.device
        h = torch.stack([inputs[b].hidden for b in have]).to(dev, self.embed.dtype)
        x = torch.tensor([inputs[b].token_ids[-1] for b in have], device=dev)
        temps = [inputs[b].temperature for b in have]
        if self.graphs is not None and not any(temps) and self.graphs.fits(len(have)):
            toks, conf = self.graphs.run(h, x, k)
            q = None
        else:
            temp = torch.tensor(temps, device=dev)
            toks, conf, q = self.head.draft(h, x, self.embed, self.lm_head, k, temp, self.generator)
        if len(have) == B:  # common case: no scatter
            return Draft(toks, torch.full((B,), k, dtype=torch.long, device=dev), conf.float(),
                         q)
        idx = torch.tensor(have, device=dev)
        T = torch.zeros(B, k, dtype=torch.long, device=dev)
        C = torch.zeros(B, k, device=dev)
        lens = torch.zeros(B, dtype=torch.long, device=dev)
        T[idx], C[idx], lens[idx] = toks, conf.float(), k
        probs = None
        if q is not None:
            probs = torch.zeros(B, k, q.shape[-1], device=dev)
            probs[idx] = q.float()
        return Draft(T, lens, C, probs)
