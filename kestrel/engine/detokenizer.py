"""Incremental detokenization with stop strings.

Decodes a sliding window of ids (a few context tokens + the new ones) instead of the whole output each step, and
waits while the text ends in an incomplete UTF-8 sequence. When stop strings are set, the last len(stop)-1
characters are held back so a stream never shows the beginning of a stop string that is then trimmed."""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-5:])  # context so the first tokens decode with the right spacing
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self._prefix: str | None = None  # decoded ids[prefix_offset:read_offset], valid until the offsets move
        self.emitted = 0
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.skip = skip_special_tokens
        # the Rust tokenizer directly: transformers' decode wrapper costs ~0.3 ms per call, twice per token
        backend = getattr(tokenizer, "_tokenizer", None)
        plain = not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._fast = backend.decode if plain and hasattr(backend, "decode") else None

    def _decode(self, ids):
        try:
            if self._fast is not None:
                return self._fast(ids, skip_special_tokens=self.skip)
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip)
        except (OverflowError, IndexError, TypeError, ValueError):  # ids outside the tokenizer (dummy shapes)
            return ""

    def add(self, new_ids: list[int]) -> bool:
        """Append tokens; returns True if a stop string was found (text is then trimmed before it)."""
        ids = self.ids
        ids.extend(new_ids)
        window = ids[self.prefix_offset:]
        if self._prefix is None:  # the context's text changes only when the offsets move: decode it once
            self._prefix = self._decode(window[:self.read_offset - self.prefix_offset])
        prefix = self._prefix
        full = self._decode(window)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            old_len = len(self.text)
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            self._prefix = None
            if self.prefix_offset > 64:  # keep the id list short (only the window is ever read)
                del ids[:self.prefix_offset]
                self.read_offset -= self.prefix_offset
                self.prefix_offset = 0
            if self.stop:
                start = max(0, old_len - self.holdback)
                hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
                if hits:
                    self.text = self.text[:min(hits)]
                    return True
        return False

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out (all of it when finished)."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
