"""Model hyper-parameters for the Llama family (Llama, Mistral, Qwen2, SmolLM), read from an HF config.json
or from GGUF metadata, so the decoder is built the same way whatever the checkpoint format."""
from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")


@dataclass
class ModelConfig:
    architecture: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q/k/v only
    o_bias: bool = False  # Llama attention_bias=True: bias on q/k/v and o
    mlp_bias: bool = False
    sliding_window: int | None = None  # Mistral; None = full attention
    # per layer "full_attention" | "sliding_attention" (HF layer_types); None = every layer sliding when
    # sliding_window is set (Mistral). Hybrid models (Qwen2 use_sliding_window + max_window_layers) set it.
    layer_types: list[str] | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.layer_types is not None:
            bad = set(self.layer_types) - {"full_attention", "sliding_attention"}
            if bad or len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types must list 'full_attention'/'sliding_attention' for each of the "
                                 f"{self.num_hidden_layers} layers, got {self.layer_types}")

    def layer_window(self, i: int) -> int | None:
        """Sliding window of layer i (keys t-W+1..t are visible), None = full attention."""
        if self.sliding_window is None or (self.layer_types is not None
                                           and self.layer_types[i] != "sliding_attention"):
            return None
        return self.sliding_window

    @property
    def swa_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.layer_window(i) is not None]

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        archs = d.get("architectures") or []
        mt = (d.get("model_type") or "").lower()
        arch = mt if mt in SUPPORTED_ARCHS else None
        if arch is None:
            for a in archs:
                for name in SUPPORTED_ARCHS:
                    if a.lower().startswith(name):
                        arch = name
            if arch is None:
                raise ValueError(f"unsupported model: model_type={mt!r} architectures={archs}")
        nh = d["num_attention_heads"]
        hidden = d["hidden_size"]
        eos = d.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        attn_bias = bool(d.get("attention_bias", False))
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        # transformers 5 nests rope settings under rope_parameters
        rp = d.get("rope_parameters")
        if isinstance(rp, dict):
            rope_theta = rp.get("rope_theta", rope_theta)
            if rp.get("rope_type", "default") != "default":
                rope_scaling = rp
        sw = d.get("sliding_window") if d.get("use_sliding_window", arch == "mistral") else None
        # which layers slide, as transformers decides: Mistral all of them (it ignores layer_types); else an
        # explicit layer_types, or for Qwen2 the layers from max_window_layers on (transformers' default 28)
        layer_types = None
        if sw is not None and arch != "mistral":
            layer_types = d.get("layer_types")
            if layer_types is None and arch == "qwen2":
                mwl = d.get("max_window_layers", 28)
                layer_types = ["sliding_attention" if i >= mwl else "full_attention"
                               for i in range(d["num_hidden_layers"])]
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=nh,
            num_key_value_heads=d.get("num_key_value_heads") or nh,
            head_dim=d.get("head_dim") or hidden // nh,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta or 10000.0,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=attn_bias or arch == "qwen2",
            o_bias=attn_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            sliding_window=sw,
            layer_types=list(layer_types) if layer_types is not None else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos,
        )

    @classmethod
    def from_gguf_fields(cls, meta: dict, has_output_tensor: bool, has_qkv_bias: bool) -> "ModelConfig":
        """meta: GGUF key -> python value (see loader_gguf.read_metadata)."""
        arch = meta["general.architecture"]
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported GGUF architecture {arch!r}")
        p = arch + "."
        nh = meta[p + "attention.head_count"]
        hidden = meta[p + "embedding_length"]
        vocab = meta.get(p + "vocab_size") or len(meta["tokenizer.ggml.tokens"])
        rope_scaling = None
        stype = meta.get(p + "rope.scaling.type")
        if stype and stype != "none":
            rope_scaling = {"rope_type": stype, "factor": meta.get(p + "rope.scaling.factor", 1.0)}
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=meta[p + "feed_forward_length"],
            num_hidden_layers=meta[p + "block_count"],
            num_attention_heads=nh,
            num_key_value_heads=meta.get(p + "attention.head_count_kv", nh),
            head_dim=meta.get(p + "attention.key_length") or hidden // nh,
            rms_norm_eps=meta.get(p + "attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=meta.get(p + "rope.freq_base", 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=meta.get(p + "context_length", 4096),
            tie_word_embeddings=not has_output_tensor,
            qkv_bias=has_qkv_bias,
            sliding_window=meta.get(p + "attention.sliding_window"),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[] if eos is None else [eos],
        )
