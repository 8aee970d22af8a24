"""Speculative decoding: drafters, the confidence scheduler and lossless verification.

Importing this package registers the speculative step with the engine (the engine sits below this layer and
never imports it): EngineConfig(speculative=SpeculativeConfig(...)) or parse_speculative("drafter=ngram,k=4").
"""
from kestrel.spec.config import SpeculativeConfig, parse_speculative


def _register() -> None:
    from kestrel.engine import llm_engine
    from kestrel.spec.factory import build_spec_decoder

    llm_engine.SPECULATIVE_BUILDER = build_spec_decoder


try:
    _register()
except (ImportError, AttributeError):  # engine not importable (partial install): spec math still usable
    pass

__all__ = ["SpeculativeConfig", "parse_speculative"]
