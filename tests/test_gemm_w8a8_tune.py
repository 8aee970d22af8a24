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

    def fake_timer(fns):
        assert len(fns) == 1  # one weight copy on the CPU (no L2 to rotate past)
        fns[0]()  # really run each candidate (it must compile and work)
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
    def timer(fns):
        raise RuntimeError("out of shared memory")
    assert tune_lowbit("w8a8-int8", [(32, 128)], [4], timer=timer, max_candidates=2, device="cpu") == {}


def test_wrong_output_is_never_stored(cache, monkeypatch):
    """a candidate that computes something else (here: one config's output scaled by 1.5) is skipped however fast,
    against the bf16 activations times the dequantized weight; the entry in use before is measured too."""
    import kestrel.kernels.gemm_w8a8 as g
    cands = candidates("w8a8-fp8", 4, 32, 128, 3)
    bad, real = cands[-1], g.run_dense
    monkeypatch.setattr(g, "run_dense", lambda *a, **k: real(*a, **k) * (1.5 if a[-1] == bad else 1.0))
    prev = cands[0]
    lowbit_tune.store("w8a8-fp8", 4, 32, 128, cands[1])
    times = iter(range(10, 0, -1))  # each measured candidate "faster" than the one before
    res = tune_lowbit("w8a8-fp8", [(32, 128)], [4], timer=lambda fns: (fns[0](), next(times))[1],
                      max_candidates=3, device="cpu")
    (v, ) = res.values()
    assert v["config"] == cands[1].as_dict() and v["previous_us"] == v["us"] and prev != bad


@pytest.mark.parametrize("kernel", [k for k in LOWBIT_KERNELS if not k.startswith("w4a8tcg")])
def test_case_reference_admits_the_kernel_and_not_a_wrong_one(kernel):
    """make_case's reference (bf16 x times the dequantized weight) and tolerance: the heuristic config's output is
    within it (else the tuner would store nothing), the same output 50 % off is not."""
    from kestrel.kernels.lowbit_tuning import make_case
    run, n, ref, tol = make_case(kernel, 4, 32, 256, "cpu")
    y = run(candidates(kernel, 4, 32, 256)[0], 0).float()
    err = lambda t: ((t - ref).norm() / ref.norm()).item()
    assert n == 1 and err(y) <= tol / 2 and err(y * 1.5) > tol


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
