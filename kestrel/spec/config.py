"""Speculative-decoding settings and the parser for the `--speculative drafter=ngram,k=4` flag."""
from __future__ import annotations

from dataclasses import dataclass, fields

DRAFTERS = ("ngram", "draft_model", "head")
SCHEDULES = ("confidence", "fixed")


@dataclass
class SpeculativeConfig:
    drafter: str = "ngram"  # ngram | draft_model | head
    k: int = 4  # most draft tokens verified per request per step
    schedule: str = "confidence"  # confidence: per-request k from drafter confidence + load; fixed: always k
    # verify tokens per step (1 per request + drafts) that the forward absorbs at ~no extra cost; None = by
    # device: the CPU turns compute-bound after a handful of tokens, a GPU only after hundreds
    token_budget: int | None = None
    min_survival: float = 0.3  # at no load, verify draft token i only if P(prefix up to i survives) >= this
    ngram_max: int = 3  # n-gram lookup: longest suffix to match
    ngram_min: int = 1
    draft_model: str | None = None  # path / HF id of the small draft model (drafter=draft_model)
    head: str | None = None  # safetensors file of a trained draft head (drafter=head)
    # overlapped device loop for all-greedy decode batches (spec_loop.py): auto = on where verify graphs exist
    # (CUDA), on = also eager (CPU tests), off = always the synchronous step
    loop: str = "auto"
    # drafter=head inside the loop: take the n-gram lookup's draft where it matched an n-gram of at least this many
    # tokens (copying beats the head there), the head's elsewhere; 0 = head only
    hybrid_ngram: int = 0
    # drafter=head on CUDA: draft greedily with the fused Triton kernels of head_fused.py (1), the PyTorch ops (0),
    # or as the KESTREL_HEAD_FUSED environment variable says (-1; on unless it is 0); a field so that one process can
    # run both side by side (bench/spec_decode.py --drafter hybrid hybrid-fused)
    head_fused: int = -1
    # drafter=head inside the loop: also verify a greedy draft tree of these widths per level, e.g. '4-2-1-1-1-1'
    # (top 4 first tokens, top 2 under each, then chains; kestrel/spec/tree.py); '' = chains only; '+6' after the
    # widths adds an n-gram branch of 6 off the root ('+6+6': and a second, another first token), e.g.
    # '4-1-1-1-1-1+6' (session 10: the best at concurrency 1). schedule=fixed then always runs the tree,
    # confidence picks tree / chain / off per step by cost
    tree: str = ""

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ValueError(f"speculative drafter must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"speculative schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.loop not in ("auto", "on", "off"):
            raise ValueError(f"speculative loop must be auto, on or off, got {self.loop!r}")
        if self.hybrid_ngram < 0:
            raise ValueError(f"speculative hybrid_ngram must be >= 0 (0 = head only), got {self.hybrid_ngram}")
        if self.head_fused not in (-1, 0, 1):
            raise ValueError(f"speculative head_fused must be -1 (environment), 0 or 1, got {self.head_fused}")
        if self.tree:
            if self.drafter != "head":
                raise ValueError("speculative tree needs drafter=head")
            from kestrel.spec.tree import TreeShape
            TreeShape.parse(self.tree)  # raises on bad widths / too many nodes
        if not (1 <= self.k <= 16):
            raise ValueError(f"speculative k must be in [1, 16], got {self.k}")
        if self.token_budget is not None and self.token_budget < 1:
            raise ValueError(f"speculative token_budget must be >= 1, got {self.token_budget}")
        if not (0.0 <= self.min_survival <= 1.0):
            raise ValueError(f"speculative min_survival must be in [0, 1], got {self.min_survival}")
        if not (1 <= self.ngram_min <= self.ngram_max):
            raise ValueError("speculative ngram_min must be >= 1 and <= ngram_max")
        if self.drafter == "draft_model" and not self.draft_model:
            raise ValueError("speculative drafter=draft_model needs draft_model=<path or HF id>")
        if self.drafter == "head" and not self.head:
            raise ValueError("speculative drafter=head needs head=<file.safetensors> (train one with `kestrel train-draft`)")


def parse_speculative(text: str | None) -> SpeculativeConfig | None:
    """'drafter=ngram,k=4,schedule=fixed' -> SpeculativeConfig; '', 'off', 'none' -> None. Bad input -> ValueError."""
    if text is None or text.strip().lower() in ("", "off", "none", "false", "0"):
        return None
    types = {f.name: f.type for f in fields(SpeculativeConfig)}
    kwargs: dict = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "=" not in part:
            raise ValueError(f"--speculative expects key=value pairs separated by commas, got {part!r}")
        key, val = (s.strip() for s in part.split("=", 1))
        if key not in types:
            raise ValueError(f"unknown --speculative key {key!r}; known: {', '.join(types)}")
        t = str(types[key]).replace(" | None", "")
        try:
            kwargs[key] = int(val) if t == "int" else float(val) if t == "float" else val
        except ValueError:
            raise ValueError(f"--speculative {key} must be a number, got {val!r}") from None
    return SpeculativeConfig(**kwargs)
