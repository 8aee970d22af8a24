"""The draft head's greedy proposal replayed from CUDA graphs, one per batch bucket.

A proposal is ~70 tiny kernels (backbone, then k sequential refine + vocab readout steps); launched eagerly they
cost more than the verify forward they feed. Inputs are copied into static buffers (padding rows keep earlier,
finite values; their outputs are discarded)."""
from __future__ import annotations

import torch


class HeadGraphs:
    def __init__(self, head, embed: torch.Tensor, lm_head: torch.Tensor, batch_sizes: list[int], readout=None):
        self.head, self.embed, self.lm_head, self.readout = head, embed, lm_head, readout
        self.batch_sizes = sorted(batch_sizes)
        B, dev = self.batch_sizes[-1], embed.device
        self.h = torch.zeros(B, embed.shape[1], dtype=embed.dtype, device=dev)
        self.x = torch.zeros(B, dtype=torch.long, device=dev)
        self.graphs, self.outputs, self.pool = {}, {}, None

    @torch.inference_mode()
    def capture(self) -> None:
        for bs in sorted(self.batch_sizes, reverse=True):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.head.draft_greedy(self.h[:bs], self.x[:bs], self.embed, self.lm_head, self.head.k,
                                           readout=self.readout)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.outputs[bs] = self.head.draft_greedy(self.h[:bs], self.x[:bs], self.embed, self.lm_head,
                                                          self.head.k, readout=self.readout)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[bs] = g
        torch.cuda.synchronize()

    def fits(self, n: int) -> bool:
        return n <= self.batch_sizes[-1]

    @torch.inference_mode()
    def run(self, h: torch.Tensor, x: torch.Tensor, k: int):
        """h [n, H], x [n] -> tokens [n, k], confidence [n, k] (copies: safe across replays)."""
        n = h.shape[0]
        bs = next(b for b in self.batch_sizes if b >= n)
        self.h[:n].copy_(h)
        self.x[:n].copy_(x)
        self.graphs[bs].replay()
        toks, conf = self.outputs[bs]
        return toks[:n, :k].clone(), conf[:n, :k].clone()
