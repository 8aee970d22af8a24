"""Overlapped speculative decoding for all-greedy decode batches: the device drafts, verifies, accepts and updates
its own state, so the host can queue step n+1 right behind step n and commit step n's tokens one step late.

Why: with a small target the synchronous speculative step (draft on the host, pack, verify, one sync, accept,
commit) costs host time on top of the forward, and async no-spec hides all of its host work; bench/results/
spec_decode.md measured 1.85-2.2 ms per speculative step against 1.48 ms per no-spec step at concurrency 1. Here
everything that depends on step n's outcome runs on the device, inside one CUDA graph per (batch bucket, K):

  draft     n-gram lookup over the token history (ngram_draft_device) or the draft head on the hidden state
  pack      ids = [last token, K drafts], positions ctx..ctx+K, cache slots from the device block table
  verify    the padded verify forward of verify_graph.py (K = 0: a plain decode through the same path)
  accept    greedy: a = length of the prefix where draft == argmax; emitted tokens = argmax[0..a]
  update    history += emitted, length += a + 1, hidden = the state at the last emitted token's row

Per-row state lives in device buffers: token history [B, Lm], length (tokens known; the last one is not cached
yet), the head's hidden state, the block table, an active flag. The host's part per step: pick K (below), make
sure every row has KV blocks for the step in flight plus this one (so a step never waits for the host), upload
the block table / active flags when they changed (pinned, non-blocking, ordered on the stream), replay, queue one
copy of [emitted count, accepted, drafted, tokens] into pinned memory with an event, then commit the previous
step: wait for its event (the device is already busy with the next step), append tokens, stop checks, outputs.

Rejected drafts need no rollback in the cache: their K/V sit at positions past the new length and are
overwritten by the next step before anything reads them (attention reads positions < seq_len only); the host
frees surplus blocks when the loop ends. A request that finishes at the commit of step n is still in step n+1:
its tokens there are discarded and the row is switched off for step n+2 (its freed blocks may be reused by other
rows from step n+2 on, which is safe on one stream: a row reads only positions it has itself written).

K per step (load- and cost-aware "confidence" schedule): the expected tokens per row with K drafts is
1 + sum_{i<=K} s_i, where s_i = P(the first i drafts survive) is a running estimate from the committed steps; the
step costs max(device time of the (B, K) graph, host time per step), both measured while running (CUDA events,
wall clock). The loop picks the K of most tokens per second, so it verifies more drafts while verification is
free (small batches: the forward is launch-bound) and turns speculation off (K = 0) when the verify costs more
than it gains (large batches), probing the largest K now and then to keep s_i current. schedule=fixed uses k.

Tree verification (tree=TreeShape, drafter=head; kestrel/spec/tree.py): one more candidate step besides the chains,
keyed K = the tree's node count. The head drafts a greedy tree (top widths[i] tokens under each branch), one verify
pass scores all its nodes under a tree attention mask, the deepest node whose whole path the target agrees with is
accepted and its path's K/V are moved to their sequence positions. Its expected tokens per row is a running mean
of its own steps; the chains' s_i learn from tree steps too (the tree's first-choice path is the chain's draft, and
tree_accept reports how far it matched), so no chain needs probing while the tree is the choice. The cost model
weighs the tree like a chain, so at large batches, where its wide verify costs real time, the loop falls back to
chains or K = 0. A tree with an n-gram branch (tree=4-1-1-1-1-1+6)
also verifies the n-gram lookup's draft as one more chain off the root (the hybrid chain's copy, without choosing).

The loop runs while the batch is all-greedy decode without logprobs or penalties and nothing waits to be admitted;
otherwise (and on a new request) it drains and the synchronous step (decoder.py) takes over.
"""
from __future__ import annotations

import os
import time

import numpy as np
import torch

from kestrel.engine.attention import to_device
from kestrel.engine.prefill_graphs import PagedChunkCtx
from kestrel.spec.ngram import ngram_draft_device
from kestrel.spec.tree import KVCompactor, tree_accept
from kestrel.spec.verify_graph import capture_graphs, pad_rows


class _Launched:
    __slots__ = ("rows", "K", "buf", "ev0", "ev1")

    def __init__(self, rows, K, buf, ev0, ev1):
        self.rows, self.K, self.buf, self.ev0, self.ev1 = rows, K, buf, ev0, ev1


def survival_weight(live: int, per_row: float = 0.02, cap: float = 0.3) -> float:
    """Weight of one step's observed survival in the running s_i: about `per_row` per observed row, at most `cap`.
    Why: with a fixed 0.3 a batch of one row swings s_i on every accept / reject (one row's outcome is 0 or 1), and
    session 7 R1's conf runs at C=1 then chose K=1 in 298-418 of ~650 steps where K=4-6 costs only 0.03-0.08 ms
    more (1x1 1.25 vs 1x6 1.33 ms) and fixed k=4 beat them (1.45x vs 1.41x); a dip of s_2 makes K=2 the choice and
    s_3.. are then only re-measured by the probes, so the dip sticks (tests/test_spec_loop.py replays it). At 18+
    rows the step's mean is already a fair sample and the weight stays 0.3 as before."""
    return min(cap, 1.0 - (1.0 - per_row) ** live)


TREE_MIN_ROWS = 32  # tree rows observed before the cost model trusts tree_tokens (C=1: 32 steps, C>=32: 1)
SHRINK_FACTOR = 4  # a loop over bucket B drains and re-enters once its live rows fit a bucket <= B / 4


def tree_estimate(prev: float, mean: float, live: int, rows_seen: int) -> float:
    """The tree's running tokens per row after a tree step whose `live` rows averaged `mean` (rows_seen counts them
    too): the plain mean of all tree rows so far until there are 1 / survival_weight of them, then the same moving
    average as the chains. Why (and TREE_MIN_ROWS): the tree is observed only on its probes (every 2nd probe, 1 step
    in 32 at C=1), so with the moving average alone its first step's single row stuck for hundreds of steps (0.02
    weight a probe): session 16's tree-conf at C=1 verified the tree in 21 of 642 steps and chain K=4 in 448, 1.46x
    against the tree's 1.72x on its own (1.64 against 2.15 tokens per verify at ~the same step cost)."""
    if not prev:
        return mean
    w = max(survival_weight(live), live / rows_seen)
    return (1 - w) * prev + w * mean


def loop_eligible(seq) -> bool:
    p = seq.params
    return p.temperature == 0.0 and p.logprobs is None and not (p.presence_penalty or p.frequency_penalty)


class SpecLoop:
    def __init__(self, runner, drafter, kind: str, k_sizes: list[int], batch_sizes: list[int], max_model_len: int,
                 schedule: str = "confidence", k: int = 4, capture: bool = True, probe_every: int = 16,
                 ngram: tuple[int, int] = (3, 1), hybrid_ngram: int = 0, tree=None):
        self.model, b = runner.model, runner.backend
        self.k_caches, self.v_caches = b.k_cache, b.v_cache
        self.dev = dev = self.k_caches[0].device
        self.use_graphs = capture and dev.type == "cuda"
        _, self.block_size, _, head_dim = self.k_caches[0].shape
        self.scale = head_dim ** -0.5
        self.window = int(runner.cfg.sliding_window or 0)
        self.kind, self.drafter = kind, drafter
        self.ngram, self.hybrid_ngram = ngram, hybrid_ngram
        self.ks = sorted({0, *k_sizes})
        self.tree, self.kt, self.t_fused = tree, None, None
        if tree is not None:
            if kind != "head" or len(tree.widths) > drafter.head.k:
                raise ValueError(f"tree verification needs the draft head, {len(tree.widths)} levels <= its "
                                 f"k={drafter.head.k}")
            self.kt = tree.n
            if self.kt in self.ks:
                raise ValueError(f"a tree of {tree.n} nodes collides with the chain K={tree.n}")
            self.t_parent, self.t_depth, self.t_bits, self.t_anc = tree.tensors(dev)
            self.t_first = torch.tensor(tree.first_path, device=dev)
            self.t_readout = drafter.head.subset_readout(drafter.embed, drafter.lm_head)
            # the tree's levels in 3 Triton launches each (head_tree_fused.py) where the chain drafts fused (CUDA,
            # head_fused on): session 9 R2's PyTorch levels cost 0.29 ms per step at batch 1, the fused chain k=6
            # 0.10 ms; KESTREL_TREE_FUSED=1 forces it (CPU tests under TRITON_INTERPRET=1), 0 turns it off (A/B)
            from kestrel.spec.head_fused import FusedGreedyDraft
            from kestrel.spec.head_tree_fused import FusedTreeDraft
            env = os.environ.get("KESTREL_TREE_FUSED", "")
            on = isinstance(getattr(drafter, "readout", None), FusedGreedyDraft) if env == "" else env == "1"
            self.t_fused = FusedTreeDraft(drafter.head, drafter.embed, drafter.lm_head, self.t_readout) \
                if on and self.t_readout is not None else None
            self.compact = KVCompactor(self.k_caches, self.v_caches)
        self.cands = self.ks + ([self.kt] if self.kt else [])  # the steps the cost model picks from
        self.schedule, self.k, self.probe_every = schedule, k, probe_every
        self.batch_sizes = sorted(batch_sizes)
        Kmax, B = max(self.cands), self.batch_sizes[-1]
        self.kchain = self.ks[-1]
        self.max_model_len = max_model_len
        self.Lm = max_model_len + 2 * (Kmax + 1)  # history: room for the writes of two steps past the context
        self.W = -(-self.Lm // self.block_size) + 4  # + the blocks taken ahead (step(): 2 blocks)
        emb = self.model.embed_tokens.weight
        self.hist = torch.zeros(B, self.Lm, dtype=torch.long, device=dev)
        self.length = torch.ones(B, dtype=torch.long, device=dev)
        self.hidden = torch.zeros(B, emb.shape[1], dtype=emb.dtype, device=dev)
        self.block_tables = torch.zeros(B, self.W, dtype=torch.int32, device=dev)
        self.active = torch.zeros(B, dtype=torch.bool, device=dev)
        # per row: n, accepted, drafted, chain (tree steps: drafts the chain would have had accepted), tokens[K+1]
        self.out = torch.zeros(B, Kmax + 5, dtype=torch.long, device=dev)
        self.cu_q = {K: (torch.arange(B + 1, dtype=torch.int32) * (K + 1)).to(dev) for K in self.cands}
        if self.kt:  # the tree's mask words for every row of the largest batch
            self.t_mask = self.t_bits.repeat(B)
        pin = dev.type == "cuda"
        self.host = [torch.zeros(B, Kmax + 5, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        # running estimates for the K choice
        self.surv = [1.0] + [0.5 ** i for i in range(1, self.kchain + 1)]  # s_i = P(first i drafts accepted)
        self.tree_tokens = 0.0  # running tokens per row of the tree steps (0: not observed yet)
        self.tree_rows = 0  # rows of tree steps observed since attach (tree_estimate's plain-mean phase)
        self._probe = 0
        self.gpu_ms: dict[tuple[int, int], float] = {}
        self.gpu_n: dict[tuple[int, int], int] = {}  # samples behind gpu_ms (the first replay of a graph is cold)
        self.host_ms = 0.0
        self.rows: list = []
        self.live: list[bool] = []
        self.k_inflight = 0
        self._wait_ms = 0.0
        self.bs = 0
        self.inflight: _Launched | None = None
        self.active_loop = False
        self.num_steps = 0
        self.num_shrinks = 0  # drains to re-enter at a smaller bucket (shrinks())
        self.wait_s = 0.0
        self.owner = None  # the SpecDecoder using the loop
        self.last_k = None  # the cost model's last choice (not counting probes)
        self._t_last = None
        self._buf = 0

    # ---- the device step ----
    def _step(self, bs: int, K: int):
        if K == self.kt and K:
            return self._step_tree(bs)
        S = K + 1
        L, hist, act = self.length[:bs], self.hist[:bs], self.active[:bs]
        ctx = L - 1
        last = hist.gather(1, ctx[:, None])
        if K:
            if self.kind == "ngram":
                d, has = ngram_draft_device(hist, L, K, *self.ngram)
            else:
                d, _ = self.drafter.head.draft_greedy(self.hidden[:bs], last[:, 0], self.drafter.embed,
                                                      self.drafter.lm_head, K, want_conf=False,
                                                      readout=getattr(self.drafter, "readout", None))
                has = torch.ones_like(act)
                if self.hybrid_ngram:
                    dn, _, nn = ngram_draft_device(hist, L, K, *self.ngram, return_n=True)
                    d = torch.where((nn >= self.hybrid_ngram)[:, None], dn, d)
            ids = torch.cat([last, d], 1)
        else:
            ids, has = last, torch.zeros_like(act)
        j = torch.arange(S, device=self.dev)[None, :]
        h, top = self._verify(bs, K, ids, ctx[:, None] + j, ctx, act)
        a = (d == top[:, :K]).long().cumprod(1).sum(1) if K else torch.zeros_like(L)
        n = torch.where(act, a + 1, 0)
        wpos = (L[:, None] + j).clamp(max=self.Lm - 1)
        hist.scatter_(1, wpos, torch.where(act[:, None], top, hist.gather(1, wpos)))
        L += n
        if self.kind == "head":
            H = h.shape[-1]
            self.hidden[:bs].copy_(h.view(bs, S, H).gather(1, a[:, None, None].expand(bs, 1, H))[:, 0])
        o = self.out[:bs]
        o[:, 0] = n
        o[:, 1] = a
        o[:, 2] = has.long()
        o[:, 4:4 + S] = top  # column 3 (chain) is the tree step's: a chain's own is `a` (_commit)

    def _cache_slots(self, bs: int, p: torch.Tensor) -> torch.Tensor:
        """paged-cache slot of sequence position p [bs, m] of the first bs rows."""
        bsz = self.block_size
        blk = self.block_tables[:bs].gather(1, (p // bsz).clamp(max=self.W - 1)).long()
        return blk * bsz + p % bsz

    def _verify(self, bs: int, K: int, ids, pos, ctx, act, tree_mask=None):
        """one target pass over the chunk ids [bs, S] (row j stored at position ctx + j, RoPE at pos): its hidden
        states and greedy tokens [bs, S]; tree_mask: the draft tree's ancestor words (chains: causal)."""
        S = ids.shape[1]
        rows = ctx[:, None] + torch.arange(S, device=self.dev)
        slots = torch.where(act[:, None], self._cache_slots(bs, rows), -1)
        seq_lens = torch.where(act, ctx + S, 0).to(torch.int32)
        vctx = PagedChunkCtx(self.k_caches, self.v_caches, self.window, self.scale, slots.reshape(-1),
                             self.block_tables[:bs], self.cu_q[K][:bs + 1], seq_lens, S, tree_mask=tree_mask)
        h = self.model(ids.reshape(-1), pos.reshape(-1), vctx)
        return h, self.model.compute_logits(h).argmax(-1).view(bs, S)

    def _step_tree(self, bs: int):
        t = self.tree
        S, D = t.n + 1, t.D
        L, hist, act = self.length[:bs], self.hist[:bs], self.active[:bs]
        ctx = L - 1
        last = hist.gather(1, ctx[:, None])
        dr = self.drafter
        if self.t_fused is not None:
            nodes = self.t_fused.tree(dr.head, self.hidden[:bs], last[:, 0], dr.embed, t.widths)
        else:
            z = None
            if self.dev.type == "cuda" and bs <= 16:  # the backbone in 5 fused launches, not 15 (as the fused chain)
                from kestrel.spec.head_gemm import fused_slots
                z = fused_slots(dr.head, self.hidden[:bs], last[:, 0], dr.embed)
            nodes = dr.head.draft_tree(self.hidden[:bs], last[:, 0], dr.embed, dr.lm_head, t.widths,
                                       readout=self.t_readout, nodes=True, z=z)
        if t.ngram:  # the n-gram branches: the lookup's draft (rows without a match repeat their last token) and
            # the latest match continuing with another first token
            dn, _ = ngram_draft_device(hist, L, t.ngram[0], *self.ngram)
            parts = [nodes, dn]
            if len(t.ngram) > 1:
                parts.append(ngram_draft_device(hist, L, t.ngram[1], *self.ngram, exclude=dn[:, 0])[0])
            nodes = torch.cat(parts, 1)
        ids = torch.cat([last, nodes], 1)
        pos = ctx[:, None] + self.t_depth[None, :]  # RoPE by depth
        h, top = self._verify(bs, t.n, ids, pos, ctx, act, tree_mask=self.t_mask[:bs * S])
        a, path, emitted, leaf, chain = tree_accept(ids, top, t, self.t_parent, self.t_depth, self.t_anc,
                                                    first_path=self.t_first)
        n = torch.where(act, a + 1, 0)
        j = torch.arange(D + 1, device=self.dev)[None, :]
        wpos = (L[:, None] + j).clamp(max=self.Lm - 1)
        hist.scatter_(1, wpos, torch.where(act[:, None], emitted, hist.gather(1, wpos)))
        # the accepted nodes' K/V: chunk row path[d] -> position ctx + d (d = 1..a)
        d = j[:, 1:]
        move = act[:, None] & (d <= a[:, None]) & (path[:, 1:] != d)
        src = torch.where(move, self._cache_slots(bs, ctx[:, None] + path[:, 1:]), -1)
        dst = torch.where(move, self._cache_slots(bs, ctx[:, None] + d), -1)
        self.compact(src, dst)
        L += n
        H = h.shape[-1]
        self.hidden[:bs].copy_(h.view(bs, S, H).gather(1, leaf[:, None, None].expand(bs, 1, H))[:, 0])
        o = self.out[:bs]
        o[:, 0] = n
        o[:, 1] = a
        o[:, 2] = 1
        o[:, 3] = chain
        o[:, 4:5 + D] = emitted

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.use_graphs:
            return
        self.active.zero_()  # warm-up and capture with every row off: nothing stored, no state moves
        graphs, _, self.pool = capture_graphs(self._step, self.batch_sizes, self.cands, self.pool)
        self.graphs.update(graphs)

    # ---- entering / leaving ----
    def attach(self, decoder) -> None:
        """The loop is shared by the decoders of one engine (its graphs are captured once): take the settings of
        the decoder that enters it; its acceptance estimates start afresh (device costs are kept)."""
        if self.owner is not decoder:
            self.owner, self.inflight, self.active_loop = decoder, None, False
            self.schedule, self.k = decoder.cfg.schedule, decoder.cfg.k
            self.surv = [1.0] + [0.5 ** i for i in range(1, self.kchain + 1)]
            self.num_steps, self.last_k, self.tree_tokens, self.tree_rows = 0, None, 0.0, 0

    def can_enter(self, engine, batch, hidden: dict) -> bool:
        seqs, ns = batch.seqs, batch.num_new_tokens
        if engine.scheduler.waiting or not seqs or len(seqs) > self.batch_sizes[-1]:
            return False
        room = 3 * (max(self.cands) + 1)
        for s, n in zip(seqs, ns):
            if n != 1 or s.num_computed_tokens != s.num_tokens - 1 or not loop_eligible(s) or \
                    s.num_tokens + room > self.max_model_len:
                return False
        return True

    @torch.inference_mode()
    def enter(self, engine, seqs, hidden: dict) -> None:
        n = len(seqs)
        self.bs = bs = next(b for b in self.batch_sizes if b >= n)
        toks, lens = pad_rows([s.token_ids for s in seqs], max(s.num_tokens for s in seqs))
        self.hist[:n, :toks.shape[1]].copy_(to_device(torch.from_numpy(toks), torch.long, self.dev))
        self.length[:n].copy_(to_device(torch.from_numpy(lens), torch.long, self.dev))
        self.length[n:bs].fill_(1)
        act = torch.zeros(bs, dtype=torch.bool)
        act[:n] = True
        self.active[:bs].copy_(to_device(act, torch.bool, self.dev))
        if self.kind == "head":
            # a row without a hidden state yet (the synchronous step ran with speculation off, e.g. under load:
            # R1 head-conf at C=64 never entered the loop) starts from zeros: its first drafts are just rejected
            # (lossless), and the loop's first verify writes the real state
            zero = torch.zeros_like(self.hidden[0])
            self.hidden[:n].copy_(torch.stack([hidden.get(s.request_id, zero) for s in seqs]))
        self.rows, self.live = list(seqs), [True] * n
        self._upload_tables()
        self.inflight, self.active_loop, self._t_last, self.k_inflight = None, True, None, 0

    def _upload_tables(self) -> None:
        tables = [s.block_table if live else [] for s, live in zip(self.rows, self.live)]
        bt, _ = pad_rows(tables, max(map(len, tables)) or 1)
        self.block_tables[:len(tables), :bt.shape[1]].copy_(to_device(torch.from_numpy(bt), torch.int32, self.dev))

    def drain(self, engine, decoder) -> list:
        """Commit the step in flight and hand the rows back to the synchronous step."""
        outs = self._commit(engine, decoder, self.inflight) if self.inflight is not None else []
        self.inflight, self.active_loop = None, False
        bm, bsz = engine.block_manager, engine.block_manager.block_size
        for r, s in enumerate(self.rows):
            if s.is_finished:
                continue
            keep = -(-(s.num_computed_tokens + 1) // bsz)
            if len(s.block_table) > keep:  # blocks taken ahead for steps that did not run
                bm.free_tail(s, keep)
            if self.kind == "head":
                decoder.hidden[s.request_id] = self.hidden[r].clone()
        self.rows = []
        return outs

    # ---- one engine step inside the loop ----
    def choose_k(self) -> int:
        if self.schedule == "fixed":  # with a tree: always the tree
            return self.kt or next((x for x in self.ks if x >= self.k), self.ks[-1])
        bs = self.bs
        untried = [K for K in reversed(self.cands) if self.gpu_n.get((bs, K), 0) < 2]
        if untried:
            return untried[0]
        if self.kt and self.tree_rows < TREE_MIN_ROWS:  # too few of the tree's rows observed since attach: measure
            return self.kt
        # probe the largest K now and then to keep s_i current (and the tree, every other probe); 4x as often while
        # speculation is off, since an off step observes nothing (R2: survival that fell on a prompt's first tokens
        # came back too slowly). While the tree is the choice nothing needs a probe: a tree step observes the chain
        # too (its first-choice path, _commit), so the chain probes that cost session 19's tree-conf ~2-4 % at C=1
        # (K=4 / 6 in 79 of 448 steps, 1.73 tokens each against the tree's 2.51) are gone there
        probing = self.num_steps % (self.probe_every // 4 if self.last_k == 0 else self.probe_every) == 0
        if probing and not (self.kt and self.last_k == self.kt):
            self._probe ^= 1
            return self.kt if self.kt and self._probe else self.kchain
        host = self.host_ms

        def rate(K):
            tokens = (self.tree_tokens or 1 + sum(self.surv[1:self.tree.D + 1])) if K == self.kt \
                else 1 + sum(self.surv[1:K + 1])
            return tokens / max(self.gpu_ms[(bs, K)], host, 1e-6)
        self.last_k = max(self.cands, key=rate)
        return self.last_k

    @torch.inference_mode()
    def step(self, engine, decoder):
        """-> (outputs, still looping). Launches step n+1, then commits step n."""
        t0 = time.perf_counter()
        if self._t_last is not None:
            dt = (t0 - self._t_last) * 1e3 - self._wait_ms
            self.host_ms = dt if self.num_steps < 2 else 0.8 * self.host_ms + 0.2 * dt
        self._t_last, self._wait_ms = t0, 0.0
        bm = engine.block_manager
        off = [r for r, s in enumerate(self.rows) if self.live[r] and s.is_finished]  # finished or aborted
        for r in off:
            self.live[r] = False
        if engine.scheduler.waiting or not any(self.live):
            return self.drain(engine, decoder), False
        if self.shrinks(sum(self.live)):  # re-enter at the smaller bucket (the engine does so in the same step)
            self.num_shrinks += 1
            return self.drain(engine, decoder), False
        K = self.choose_k()
        need = self.k_inflight + K + 2  # tokens past the cached ones: the step in flight + this one
        changed = False
        for r, s in enumerate(self.rows):
            if not self.live[r]:
                continue
            if s.num_tokens + self.k_inflight + K + 1 > self.max_model_len:
                return self.drain(engine, decoder), False
            if bm.blocks_needed(s, need):
                # take a few blocks ahead: fewer block-table uploads; exactly what is needed if KV is tight
                if not (bm.allocate(s, need + 2 * bm.block_size) or bm.allocate(s, need)):
                    return self.drain(engine, decoder), False
                changed = True
        if changed or off:
            self._upload_tables()
        if off:
            act = torch.zeros(self.bs, dtype=torch.bool)
            act[:len(self.rows)] = torch.tensor(self.live)
            self.active[:self.bs].copy_(to_device(act, torch.bool, self.dev))
        launched = self._launch(K)
        engine.num_steps += 1
        prev, self.inflight, self.k_inflight = self.inflight, launched, K
        outs = self._commit(engine, decoder, prev) if prev is not None else []
        return outs, True

    def shrinks(self, live: int) -> bool:
        """Whether `live` rows fit a bucket a quarter of the current one or smaller. Why: in a burst the rows
        finish at different steps, and the last ones set the wall time, yet each of their steps paid the full
        bucket's verify (s16 H100, C=64: 64x30 3.0 ms vs 1x30 1.46 ms), so the cost model kept the cheap chains
        where a small batch would take the tree. A drain costs one step's overlap; the factor 4 bounds how often."""
        b = next(b for b in self.batch_sizes if b >= live)
        return SHRINK_FACTOR * b <= self.bs

    def _launch(self, K: int) -> _Launched:
        cuda = self.dev.type == "cuda"
        ev0 = ev1 = None
        if cuda:
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
        else:
            t = time.perf_counter()
        if self.use_graphs:
            self.graphs[(self.bs, K)].replay()
        else:
            self._step(self.bs, K)
        buf = self.host[self._buf]
        self._buf ^= 1
        n = len(self.rows)
        buf[:n].copy_(self.out[:n], non_blocking=cuda)
        if cuda:
            ev1.record()
        else:
            ev1 = (time.perf_counter() - t) * 1e3
        self.num_steps += 1
        ks = self.owner.loop_k_steps
        ks[K] = ks.get(K, 0) + 1
        return _Launched(list(self.rows), K, buf, ev0, ev1)

    def _commit(self, engine, decoder, fl: _Launched) -> list:
        if fl.ev0 is not None:
            t = time.perf_counter()
            fl.ev1.synchronize()
            w = time.perf_counter() - t
            self.wait_s += w
            self._wait_ms += w * 1e3
            ms = fl.ev0.elapsed_time(fl.ev1)
        else:
            ms = fl.ev1
        key = (self.bs, fl.K)
        # the first sample of a (batch, K) graph is its cold first replay (R1 of session 4: 1x4 read 1.84 ms in the
        # confidence run vs 1.46 ms at fixed K=4, and K=4 was then hardly chosen): the second replaces it
        n = self.gpu_n.get(key, 0)
        self.gpu_n[key] = n + 1
        self.gpu_ms[key] = ms if n < 2 else 0.8 * self.gpu_ms[key] + 0.2 * ms
        res = fl.buf[:len(fl.rows)].tolist()
        now = time.monotonic()
        bm, K = engine.block_manager, fl.K
        outputs, spec, acc = [], [], []
        tree = K == self.kt
        Kc = min(len(self.tree.widths), self.kchain) if tree else K  # chain depth observed
        reach = np.zeros(Kc + 1)
        live = 0
        for r, s in enumerate(fl.rows):
            if s.is_finished:  # finished at an earlier commit (or aborted): this step's tokens are discarded
                continue
            n, a, has = res[r][:3]
            c = res[r][3] if tree else a  # drafts the chain accepted
            outputs.append(engine._append_tokens(s, res[r][4:4 + n], now))
            live += 1
            reach[:min(c, Kc) + 1] += 1
            if K and has:
                spec.append(s)
                acc.append(a)
            if s.is_finished:
                decoder.hidden.pop(s.request_id, None)
                decoder.drafter.release(s.request_id)
            else:
                s.num_computed_tokens = s.num_tokens - 1
                bm.register_full_blocks(s)
        if spec:
            decoder.num_verifies += len(spec)
            decoder.num_draft_tokens += K * len(spec)
            decoder.num_accepted_tokens += sum(acc)
        if live and tree:  # the tree's own running tokens per row
            self.observe_tree(float(sum(acc)), live)
        if live and Kc:  # survival: what a chain of the head accepted (a tree step: along that path)
            self.observe(reach, live, Kc)
        return outputs

    def observe_tree(self, accepted: float, live: int) -> None:
        """Fold one committed tree step into tree_tokens: its `live` rows accepted `accepted` drafts in all."""
        self.tree_rows += live
        self.tree_tokens = tree_estimate(self.tree_tokens, 1 + accepted / live, live, self.tree_rows)

    def observe(self, reach, live: int, K: int) -> None:
        """Fold one committed step into s_i: reach[i] of its `live` rows accepted at least i of K drafts."""
        w = survival_weight(live)
        for i in range(1, K + 1):
            self.surv[i] = (1 - w) * self.surv[i] + w * reach[i] / live
        for i in range(K + 1, len(self.surv)):  # unobserved slots: no more likely than the last observed
            self.surv[i] = min(self.surv[i], self.surv[K])

