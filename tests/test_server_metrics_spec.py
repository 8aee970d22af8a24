"""/metrics exports the speculative-decoding counters that the engine keeps (acceptance rate, mean accepted length)."""
from prometheus_client.parser import text_string_to_metric_families

import kestrel.spec  # noqa: F401  (registers the speculative step with the engine)
from kestrel.engine.llm_engine import LLMEngine
from kestrel.engine.sampling_params import SamplingParams
from kestrel.server.metrics import Metrics

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


def _scrape(metrics: Metrics) -> dict[str, float]:
    return {s.name: s.value for fam in text_string_to_metric_families(metrics.render().decode()) for s in fam.samples}


def test_spec_counters_exported():
    e = LLMEngine(load_format="dummy", model_shape=SHAPE, num_kv_blocks=64, block_size=4, progress=False,
                  speculative="drafter=ngram,k=4")
    plain = _scrape(Metrics(LLMEngine(load_format="dummy", model_shape=SHAPE, num_kv_blocks=16, block_size=4,
                                      progress=False).stats, "m"))
    assert not any(k.startswith("kestrel_spec_decode") for k in plain)  # absent when speculation is off
    e.generate(["1 2 3 4 5 1 2 3 4 5 1 2", "0 0 1 1 2 2 0 0 1 1"],
               SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    s, m = e.stats(), _scrape(Metrics(e.stats, "m"))
    drafted, accepted = m["kestrel_spec_decode_num_draft_tokens_total"], m["kestrel_spec_decode_num_accepted_tokens_total"]
    assert drafted == s["spec_num_draft_tokens"] > 0 and accepted == s["spec_num_accepted_tokens"] > 0
    assert abs(m["kestrel_spec_decode_acceptance_rate"] - accepted / drafted) < 1e-9
    verifies = m["kestrel_spec_decode_num_drafts_total"]
    assert abs(m["kestrel_spec_decode_mean_accepted_length"] - (accepted + verifies) / verifies) < 1e-9
