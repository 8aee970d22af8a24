"""Build the drafter + SpecDecoder an engine needs from a SpeculativeConfig."""
from __future__ import annotations

import torch

from kestrel.spec.config import SpeculativeConfig
from kestrel.spec.decoder import SpecDecoder
from kestrel.spec.drafter import Drafter


def _model_logits_fn(model, device):
    """Any kestrel causal LM as a draft-model callable (full recompute per call: meant for small drafts)."""
    from kestrel.spec.train_draft import _CausalCtx

    ctx = _CausalCtx()

    @torch.inference_mode()
    def fn(batch: list[list[int]]) -> torch.Tensor:
        rows = []
        for t in batch:
            h = model(torch.tensor(t, device=device), torch.arange(len(t), device=device), ctx)
            rows.append(model.compute_logits(h[-1:]))
        return torch.cat(rows).float()
    return fn


def build_drafter(cfg: SpeculativeConfig, engine) -> Drafter:
    if cfg.drafter == "ngram":
        from kestrel.spec.ngram import NgramDrafter
        return NgramDrafter(cfg.ngram_max, cfg.ngram_min)
    if cfg.drafter == "head":
        from kestrel.spec.draft_head import DraftHead
        from kestrel.spec.head_drafter import HeadDrafter
        head = DraftHead.load(cfg.head, device=engine.config.device)
        if head.context:
            raise ValueError(f"{cfg.head}: a context-attention head (context={head.context}) is offline-only so far "
                             "(bench/draft_acceptance.py): the speculative loop keeps only the last hidden state")
        m = engine.model
        d = HeadDrafter(head, m.embed_tokens.weight, m.lm_head.weight,
                        fused=None if cfg.head_fused < 0 else bool(cfg.head_fused))
        if getattr(engine.runner, "graphs", None) is not None:  # the engine replays decode graphs: so does the head
            d.enable_cuda_graphs(engine.runner.graphs.batch_sizes)
        return d
    if cfg.drafter == "draft_model":
        from kestrel.model import load_model
        from kestrel.spec.draft_model import DraftModelDrafter
        d = load_model(cfg.draft_model, dtype=engine.config.torch_dtype, device=engine.config.device,
                       progress=engine.config.progress)
        if d.config.vocab_size != engine.model_config.vocab_size:
            raise ValueError(f"draft model vocab {d.config.vocab_size} != target vocab {engine.model_config.vocab_size}")
        return DraftModelDrafter(_model_logits_fn(d.model, engine.config.device))
    raise ValueError(f"unknown drafter {cfg.drafter!r}")


def build_spec_decoder(engine, cfg: SpeculativeConfig | str | dict) -> SpecDecoder | None:
    """The engine's SPECULATIVE_BUILDER: EngineConfig.speculative may be a SpeculativeConfig, the flag text
    ('drafter=ngram,k=4') or a dict of SpeculativeConfig fields."""
    from kestrel.spec.config import parse_speculative

    if isinstance(cfg, str):
        cfg = parse_speculative(cfg)
        if cfg is None:
            return None
    elif isinstance(cfg, dict):
        cfg = SpeculativeConfig(**cfg)
    elif not isinstance(cfg, SpeculativeConfig):
        raise ValueError(f"speculative must be a SpeculativeConfig, a 'drafter=...,k=...' string or a dict, got {cfg!r}")
    dec = SpecDecoder(cfg, build_drafter(cfg, engine), engine.config.device)
    dec.graphs = verify_graphs(engine, cfg.k)
    dec.loop = spec_loop(engine, cfg, dec.drafter)
    return dec


def spec_loop(engine, cfg: SpeculativeConfig, drafter):
    """The overlapped device loop (spec_loop.py) for this drafter, or None: loop=off, a drafter it cannot run on
    the device (draft model), or loop=auto without verify graphs (CPU, eager engines). Cached on the runner per
    (drafter, K sizes): the bench and the server build several decoders on one engine; capture happens once."""
    from kestrel.spec.head_drafter import HeadDrafter
    from kestrel.spec.ngram import NgramDrafter
    from kestrel.spec.spec_loop import SpecLoop
    from kestrel.spec.verify_graph import default_k_buckets

    runner = engine.runner
    graphs = getattr(runner, "graphs", None)
    if cfg.loop == "off" or (cfg.loop == "auto" and graphs is None) or not hasattr(engine, "run_batch"):
        return None
    if isinstance(drafter, NgramDrafter):
        key, kind, kmax = ("ngram", cfg.ngram_max, cfg.ngram_min), "ngram", max(cfg.k, 4)
    elif isinstance(drafter, HeadDrafter):
        key, kind, kmax = ("head", id(drafter.head), cfg.ngram_max, cfg.ngram_min, cfg.hybrid_ngram, cfg.tree), \
            "head", min(max(cfg.k, 4), drafter.head.k)
    else:
        return None
    ks = tuple(default_k_buckets(kmax))
    cache = runner.__dict__.setdefault("spec_loops", {})
    if (key, ks) not in cache:
        from kestrel.engine.cuda_graphs import default_batch_buckets
        sizes = graphs.batch_sizes if graphs is not None else default_batch_buckets(engine.config.max_num_seqs)
        try:
            from kestrel.spec.tree import TreeShape
            tree = TreeShape.parse(cfg.tree) if cfg.tree and kind == "head" else None
            loop = SpecLoop(runner, drafter, kind, list(ks), sizes, engine.max_model_len, cfg.schedule, cfg.k,
                            ngram=(cfg.ngram_max, cfg.ngram_min), hybrid_ngram=cfg.hybrid_ngram, tree=tree)
            loop.capture()
        except Exception:  # keep serving through the synchronous step, and say why
            if cfg.loop == "on":
                raise
            import traceback
            traceback.print_exc()
            print("kestrel.spec: the overlapped speculative loop is off (capture failed, see above)", flush=True)
            loop = None
        cache[(key, ks)] = loop
    return cache[(key, ks)]


def verify_graphs(engine, k: int):
    """Captured verify forwards for the engine's decode batch buckets and K <= max(k, 4), or None where the engine
    replays no decode graphs (CPU, --no-cuda-graphs, tensor parallel). Captured once per engine: kept on the runner,
    so decoders built later (other k, other drafter) reuse them."""
    from kestrel.spec.verify_graph import VerifyGraphs, default_k_buckets

    runner = engine.runner
    if getattr(runner, "graphs", None) is None:
        return None
    ks = tuple(default_k_buckets(max(k, 4)))
    cache = runner.__dict__.setdefault("spec_verify_graphs", {})
    if ks not in cache:
        b = runner.backend
        g = VerifyGraphs(runner.model, b.k_cache, b.v_cache, runner.graphs.batch_sizes, list(ks),
                         -(-engine.max_model_len // runner.block_size), runner.cfg.sliding_window)
        g.capture()
        cache[ks] = g
    return cache[ks]
