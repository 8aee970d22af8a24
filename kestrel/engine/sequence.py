"""Per-request state held by the scheduler: token ids, progress through the prompt, KV block table."""
from __future__ import annotations

import enum
import time

import torch

from .sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output, grows by one per decode step
        self.prompt_len = len(prompt_token_ids)
        self.params = params
        self.status = SeqStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache (first schedule)
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the leading full blocks (prefix cache)
        # bounded SWA KV (swa_kv.py): the SWA layers' own block table, and the end of the prefix-cache hit that
        # is being replayed (positions below it already have full-layer K/V)
        self.swa_block_table: list[int] = []
        self.replay_end = 0
        self.finish_reason: str | None = None
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        # a seeded request owns its generator so its samples do not depend on batch composition
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.detok = None  # set by the engine (IncrementalDetokenizer)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED
