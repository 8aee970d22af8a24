"""Tuning of the grouped MoE GEMM: `tune_moe` measures candidates of both projections, stores the fastest, and
FusedMoE then launches with it (timing replaced by a deterministic fake: no timing thresholds in tests)."""
import pytest
import torch

from kestrel.kernels import act_quant as aq
from kestrel.kernels import moe_tune
from kestrel.kernels.moe_mv import MvConfig

pytestmark = pytest.mark.skipif(not aq.use_triton(torch.empty(0)), reason="needs TRITON_INTERPRET=1 (or a GPU)")


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("KESTREL_LOWBIT_TUNE_CACHE", str(tmp_path / "lowbit.json"))
    monkeypatch.setitem(moe_tune.MOE_MODELS, "tiny", (4, 2, 256, 128))  # E, top_k, hidden, intermediate
    return moe_tune.MOE_MODELS["tiny"]


def test_candidates_share_block_m_and_fit_k():
    for kern in moe_tune.MOE_KERNELS:
        for M in (1, 64, 1024):
            c = moe_tune.candidates(kern, M, 128, 8, 1536, 2048)
            assert len(set(c)) == len(c) and len({x.BM for x in c}) == 1
            assert all(2048 % (128 * x.SPLIT_K) == 0 for x in c)


def test_tune_stores_the_fastest_and_the_layer_uses_it(tiny, monkeypatch):
    calls = []

    def fake_timer(fn):
        fn()  # really run each candidate (it must compile and work)
        calls.append(1)
        return 10.0 - len(calls)  # later candidates "faster": the last one measured must win

    res = moe_tune.tune_moe("tiny", "moe-int4p", [3], timer=fake_timer, device="cpu", max_candidates=2)
    assert len(res) == 2 and len(calls) == 4  # two projections x two candidates
    E, k, H, I = tiny
    want = {}
    for N, K in ((2 * I, H), (H, I)):
        run, heur = moe_tune.make_case("moe-int4p", 3, E, k, N, K, "cpu", n_routings=1)
        want[N, K] = moe_tune.candidates("moe-int4p", 3, E, k, N, K, heur)[1]
        assert moe_tune.lookup("moe-int4p", 4, E, k, N, K, want[N, K].BM) == want[N, K]  # same M bucket (4)
        assert moe_tune.lookup("moe-int4p", 3, E, k, N, K, 64) is None  # another block_m: not usable
    from kestrel.kernels import moe_gemm
    from kestrel.kernels.moe_layer import FusedMoE
    seen = []
    real = moe_gemm.grouped_gemm_planar
    monkeypatch.setattr(moe_gemm, "grouped_gemm_planar", lambda *a, **kw: seen.append(a[6]) or real(*a, **kw))
    moe = FusedMoE.from_float(torch.randn(E, H), torch.randn(E, 2 * I, H) * 0.1, torch.randn(E, H, I) * 0.1, k,
                              "int4", planar=True)
    moe(torch.randn(3, H).to(torch.bfloat16))
    assert seen == [want[2 * I, H], want[H, I]] and all(isinstance(c, MvConfig) for c in seen)


def test_tcg_entries_round_trip_through_the_cache(tiny):
    """a Gluon tcg winner is stored with kind "tcg" and comes back as a TcgConfig (the layer then runs it, or the tc
    kernel where Gluon cannot run)."""
    from kestrel.kernels import moe_gemm
    if moe_gemm.moe_tcg is None:
        pytest.skip("no Gluon in this Triton")
    cands = moe_tune.candidates("moe-int4p", 1024, 128, 8, 1536, 2048)
    tcg = [c for c in cands if isinstance(c, moe_gemm.TcgConfig)]
    assert tcg and all(c.BM == cands[0].BM for c in tcg) and {c.SWAP for c in tcg} == {0, 1, 2}
    moe_tune.store("moe-int4p", 1024, 128, 8, 1536, 2048, tcg[0], 100.0, 120.0)
    moe_tune._LOOKUPS.clear()
    assert moe_tune.lookup("moe-int4p", 1024, 128, 8, 1536, 2048, tcg[0].BM) == tcg[0]
