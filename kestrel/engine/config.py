"""Engine settings (see docs/CONTRACTS.md). Validation raises ValueError with a user-facing message."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


@dataclass
class EngineConfig:
    model: str | None = None  # None = embedded SmolLM2 GGUF
    dtype: str = "float32"
    device: str = "cpu"
    max_num_seqs: int = 64  # max sequences in one batch
    max_model_len: int | None = None  # None = model's context length (capped by KV capacity)
    max_num_batched_tokens: int = 512  # chunked-prefill token budget per step
    block_size: int = 16
    kv_cache_gb: float = 1.0
    num_kv_blocks: int | None = None  # overrides kv_cache_gb (tests use a tiny cache to force preemption)
    enable_prefix_caching: bool = True
    load_format: str = "auto"  # "auto" | "dummy"
    model_shape: dict | str | None = None  # load_format="dummy": a known shape name or ModelConfig fields
    quantization: str | None = None  # quantize-on-load scheme (kestrel.model.quantize), None = keep float weights
    seed: int = 0
    async_scheduling: bool | None = None  # overlap scheduling of step n+1 with step n; None = auto (on)
    progress: bool = True  # progress bar while loading
    cuda_graphs: bool = True  # GPU: replay decode steps from captured CUDA graphs (--no-cuda-graphs: eager)
    # KV offload (kv_offload.py): evicted prefix-cache blocks are kept in host memory (and optionally on disk)
    kv_offload_gb: float = field(default=0.0, metadata={
        "help": "host-memory tier for evicted prefix-cache KV blocks, in GB; 0 = off"})
    kv_offload_disk_dir: str | None = field(default=None, metadata={
        "help": "directory for a disk tier below the host tier (needs --kv-offload-disk-gb)"})
    kv_offload_disk_gb: float = field(default=0.0, metadata={"help": "size of the disk KV tier in GB"})
    # sliding-window layers (kestrel/engine/swa_kv.py): bounded per-sequence SWA KV, rebuilt by replay on a prefix hit
    swa_bounded_kv: bool | None = field(default=None, metadata={
        "help": "for models with sliding-window (SWA) layers, keep only each sequence's last window of their KV "
                "(not in the prefix cache) and rebuild it after a prefix-cache hit by replaying tokens; default: "
                "on for such models unless speculative decoding, tensor parallelism or CUDA graphs are on "
                "(or KV offload, for a model without full-attention layers); "
                "--no-swa-bounded-kv keeps full-length KV for every layer"})
    swa_replay_tokens: int = field(default=128, metadata={
        "help": "tokens of a cached prefix recomputed to rebuild the SWA layers' KV on a prefix-cache hit (rounded "
                "up to a block boundary); raised to the exactness bound num_swa_layers x (window - 1) unless "
                "--no-swa-replay-exact"})
    swa_replay_exact: bool = field(default=True, metadata={
        "help": "replay at least num_swa_layers x (window - 1) tokens, which makes a prefix-cache hit exact; "
                "--no-swa-replay-exact replays just --swa-replay-tokens and warns if that is fewer "
                "(faster, logits may differ slightly from a full prefill)"})
    # kestrel.spec.SpeculativeConfig or its flag text (the spec layer registers the step builder)
    speculative: str | None = field(default=None, metadata={
        "help": "speculative decoding, e.g. 'drafter=ngram,k=4' or 'drafter=head,head=FILE,k=4,schedule=fixed'; "
                "keys: drafter (ngram|draft_model|head), k, schedule (confidence|fixed), token_budget, "
                "min_survival, ngram_max, ngram_min, draft_model, head; default: off"})

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.kv_offload_gb < 0 or self.kv_offload_disk_gb < 0:
            raise ValueError("kv_offload_gb and kv_offload_disk_gb must be >= 0")
        if self.kv_offload_disk_gb > 0 and not self.kv_offload_disk_dir:
            raise ValueError("kv_offload_disk_gb needs kv_offload_disk_dir")
        if self.kv_cache_gb <= 0:
            raise ValueError("kv_cache_gb must be > 0")
        if self.swa_replay_tokens < 0:
            raise ValueError("swa_replay_tokens must be >= 0")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        self._check_device()

    def _check_device(self) -> None:
        try:
            dev = torch.device(self.device)
        except RuntimeError:
            raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda', got {self.device!r}") from None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {self.device!r} asked for, but no CUDA GPU is available to this torch build "
                                 f"({torch.__version__}); use --device cpu")
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                raise ValueError(f"device {self.device!r} does not exist: {torch.cuda.device_count()} CUDA device(s)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]
