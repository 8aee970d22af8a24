"""What the engine hands back after each step, one object per request that made progress."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)  # slots: one is built per request per step
class RequestOutput:
    request_id: str
    new_token_ids: list[int]  # tokens produced by this step (can be >1 with speculative decoding)
    output_token_ids: list[int]  # all tokens produced so far
    new_text: str = ""  # detokenized delta (stop strings already trimmed)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    prompt_len: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: list[dict] | None = None  # per new token: {"token_id", "logprob", "top": {id: logprob}}
    metrics: dict = field(default_factory=dict)
    text: str = ""  # all text so far (stop strings trimmed); complete once finished
