"""Continuous batching with chunked prefill and preemption by recompute.

Every step has a token budget (max_num_batched_tokens). Running sequences go first (a decode costs 1 token, an
unfinished prefill takes the next chunk), then waiting ones join while budget, batch slots and KV blocks allow.
When a running sequence cannot get a block, the most recently admitted running sequence is preempted: its blocks
are freed (its full blocks stay in the prefix cache, so recompute is often cheap) and it returns to the head of
the waiting queue."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SeqStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    def __len__(self):
        return len(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int | None = None):
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of which were found

    def add(self, seq: Sequence) -> None:
        # waiting stays ordered by priority (lower first), FIFO within a class: batch work never delays
        # an interactive request's admission
        prio = seq.params.priority
        if not self.waiting or self.waiting[-1].params.priority <= prio:
            self.waiting.append(seq)
            return
        pos = next(i for i, w in enumerate(self.waiting) if w.params.priority > prio)
        self.waiting.insert(pos, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        running, mml = self.running, self.max_model_len
        while i < len(running) and budget > 0:
            seq = running[i]
            ntok = len(seq.token_ids)
            # _done_on_length, inlined (this loop runs once per running sequence per step)
            if ntok - seq.prompt_len >= seq.params.max_tokens or (mml is not None and ntok >= mml):
                i += 1
                continue
            n = ntok - seq.num_computed_tokens
            if n > budget:
                n = budget
            while not self.bm.allocate(seq, n):
                preempted = True
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            cached = self.bm.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.bm.allocate(seq, n):
                self.bm.free_seq(seq)  # drop the prefix-cache references taken above
                break
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += cached
            if seq.num_output_tokens == 0:
                seq.num_cached_tokens = cached
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def _done_on_length(self, seq: Sequence) -> bool:
        """Async scheduling: a sequence whose uncommitted last token reaches max_tokens / the context will stop at
        commit; scheduling it again would only waste a step (and could ask for a block past the context)."""
        return seq.num_output_tokens >= seq.params.max_tokens or (
            self.max_model_len is not None and seq.num_tokens >= self.max_model_len)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
