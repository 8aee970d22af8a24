"""Tuning layer of the low-bit GEMMs: `tune_lowbit` measures candidates, stores the fastest, and the kernels then
launch with it (timing replaced by a deterministic fake: no timing thresholds in tests)."""
import pytest
import torch

from kestrel.kernels import act_quant as aq
from kestrel.kernels import lowbit_tune
from kestrel.kernels.lowbit_gemm import heuristic_config
from kestrel.kernels.lowbit_tuning import LOWBIT_KERNELS, W_CODE, candidates, tune_lowbit

pytestmark = pytest.mark.skipif(not aq.use_triton(torch.empty(0)), reason="needs TRITON_INTERPRET=1 (or a GPU)")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KESTREL_LOWBIT_TUNE_CACHE", str(tmp_path / "lowbit.json"))
    return tmp_path / "lowbit.json"


def test_candidates_start_with_the_heuristic_and_fit_k():
    for kernel in LOWBIT_KERNELS:
        if kernel.startswith("w4a8tcg"):
            continue  # test_gluon_w4a8_candidates
        c = candidates(kernel, 16, 4096, 4096)
        assert c[0] == heuristic_config(16, 4096, 4096, LOWBIT_KERNELS[kernel][0], W_CODE[LOWBIT_KERNELS[kernel][1]])
        assert len(set(c)) == len(c) and all(4096 % (x.BK * x.SPLIT_K) == 0 for x in c)


def test_tune_stores_the_fastest_and_the_kernel_uses_it(cache, monkeypatch):
    calls = []

    def fake_timer(fn):
        fn()  # really run each candidate (it must compile and work)
        calls.append(1)
        return 10.0 - len(calls)  # later candidates "faster": the last one measured must win

    res = tune_lowbit("w8a8-fp8", [(32, 128)], [4], timer=fake_timer, max_candidates=3, device="cpu")
    (key, v), = res.items()
    winner = candidates("w8a8-fp8", 4, 32, 128, 3)[-1]
    assert v["config"] == winner.as_dict() and len(calls) == 3
    assert lowbit_tune.lookup("w8a8-fp8", 3, 32, 128) == winner  # same M bucket (4)
    assert lowbit_tune.lookup("w8a8-fp8", 64, 32, 128) is None  # other bucket: heuristic

    seen = []
    import kestrel.kernels.gemm_w8a8 as g
    real = g.run_dense
    monkeypatch.setattr(g, "run_dense", lambda *a, **k: seen.append(a[-1]) or real(*a, **k))
    from kestrel.kernels.gemm_w8a8 import gemm_w8a8, quantize_weight_w8a8
    wq, ws = quantize_weight_w8a8(torch.randn(32, 128), "fp8")
    a, s = aq.ref_quant_fp8(torch.randn(4, 128))
    gemm_w8a8(a, s, wq, ws)
    assert seen == [winner]


def test_failing_candidate_is_skipped(cache):
    def timer(fn):
        raise RuntimeError("out of shared memory")
    assert tune_lowbit("w8a8-int8", [(32, 128)], [4], timer=timer, max_candidates=2, device="cpu") == {}


def test_unknown_kernel():
    from kestrel.kernels.lowbit_tuning import make_case
    with pytest.raises(ValueError):
        make_case("w2a2", 1, 32, 128, "cpu")


@pytest.mark.parametrize("M", [64, 256, 4096])
def test_gluon_w4a8_candidates(M):
    """the Gluon W4A8 kernels' search space: pick_tile's launch first, distinct, token tiles 128 / 256, every
    split leaves each part a K step (nonempty_split)."""
    from kestrel.kernels.gemm_w4a8_tcg import pick_tile
    for kernel in ("w4a8tcg-int4", "w4a8tcg-mxfp4"):
        c = candidates(kernel, M, 8192, 1024)
        bm, _, sp = pick_tile(M, 8192, 1024, 132)
        assert (c[0].BM, c[0].SPLIT_K, c[0].num_stages) == (bm, sp, 4)
        assert len(set(c)) == len(c) and {x.BM for x in c} == {128, 256}
        assert all(x.SPLIT_K >= 1 and (x.SPLIT_K - 1) * -(-8 // x.SPLIT_K) < 8 for x in c)


def test_gluon_w4a8_takes_only_its_own_shapes_entry(cache):
    """gemm_w4a8_tcg._tuned: a tuned entry of this exact shape is used, a neighbour's is not (its split and tile
    follow from its own N; pick_tile decides instead), while lookup's default still takes the nearest shape."""
    from kestrel.kernels.gemm_w4a8_tcg import _tuned
    from kestrel.kernels.lowbit_gemm import GemmConfig
    cfg = GemmConfig(BM=128, BN=128, BK=128, SPLIT_K=2, num_warps=4, num_stages=3)
    lowbit_tune.store("w4a8tcg-int4", 256, 8192, 8192, cfg)
    assert _tuned("w4a8tcg-int4", 256, 8192, 8192, None, None, None) == (128, 2, 3)
    assert lowbit_tune.lookup("w4a8tcg-int4", 256, 4096, 14336) == cfg  # the neighbour, for the other kernels
    assert _tuned("w4a8tcg-int4", 256, 4096, 14336, None, None, None) == (None, None, None)
    assert _tuned("w4a8tcg-int4", 256, 8192, 8192, 256, None, None) == (256, None, None)  # given: as given
