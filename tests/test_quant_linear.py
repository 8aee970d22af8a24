"""QuantLinear (CPU reference path and the Triton kernel under the interpreter) and the tune-cache lookup."""
import json
import os

import pytest
import torch
from torch import nn

from kestrel.kernels.configs import ComputeConfig, LayerConfig, TuningConfig, cache_key, heuristic, m_bucket
from kestrel.kernels.quant_linear import QuantLinear
from kestrel.quant import QuantSpec, dequantize, quantize


def test_quant_linear_cpu_matches_dequant_linear():
    torch.manual_seed(0)
    lin = nn.Linear(256, 48, bias=True)
    ql = QuantLinear.from_float(lin, QuantSpec("uint4", has_zero_point=True, group_size=64))
    x = torch.randn(3, 5, 256)
    ref = x @ dequantize(ql.qweight_struct).t() + lin.bias
    y = ql(x)
    assert y.shape == (3, 5, 48) and torch.allclose(y, ref, atol=1e-4, rtol=1e-4)
    # and it is a quantization of the original layer, not something unrelated
    assert ((y - lin(x)).norm() / lin(x).norm()) < 0.2
    assert "in_features=256" in repr(ql) and "uint4" in repr(ql)
    assert set(ql.state_dict()) >= {"qweight", "scales", "zeros", "bias"}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="kernel path needs TRITON_INTERPRET=1 on CPU")
def test_quant_linear_kernel_path_matches_cpu_path():
    torch.manual_seed(1)
    w = torch.randn(64, 256)
    ref_layer = QuantLinear.from_float(w, QuantSpec("fp4_e2m1", group_size=32, scale_dtype="e8m0"))
    ker_layer = QuantLinear(ref_layer.qweight_struct, use_kernel=True)
    x = torch.randn(4, 256).bfloat16()
    y_ref, y = ref_layer(x.float()), ker_layer(x)
    assert ((y.float() - y_ref).norm() / y_ref.norm()) < 1e-2


def test_quant_linear_rejects_non_wna16():
    with pytest.raises(ValueError):
        QuantLinear(quantize(torch.randn(16, 64), QuantSpec("int4", act_dtype="fp8_e4m3", group_size=32)))


def test_tune_cache_lookup(tmp_path, monkeypatch):
    layer = LayerConfig(QuantSpec("int4"), 4096, 4096)
    cache = tmp_path / "tune.json"
    monkeypatch.setenv("KESTREL_TUNE_CACHE", str(cache))
    tc = TuningConfig("FakeGPU")
    assert tc.lookup(layer, 3) == heuristic(layer, 3)  # no cache: heuristic
    tuned = ComputeConfig("dot", 16, 128, 0, 2, 4, 5)
    cache.write_text(json.dumps({cache_key("FakeGPU", layer, m_bucket(3)): {"config": tuned.to_dict(), "us": 1.0}}))
    assert tc.lookup(layer, 3) == tuned and tc.lookup(layer, 4) == tuned  # 3 and 4 share the bucket
    assert tc.lookup(layer, 16) == heuristic(layer, 16)  # other bucket untouched
    assert TuningConfig("OtherGPU").lookup(layer, 3) == heuristic(layer, 3)  # keyed by GPU name
    bad = ComputeConfig("dequant_mm", 16, 128, 96)  # does not divide K: ignored
    cache.write_text(json.dumps({cache_key("FakeGPU", layer, 4): {"config": bad.to_dict()}}))
    assert tc.lookup(layer, 4) == heuristic(layer, 4)
    # large M: the overlapped dequant + cuBLAS entry keeps its chunks; an entry written before `chunks` existed
    # reads as one pass
    over = ComputeConfig("dequant_mm", 1, 128, 128, 1, 8, 1, chunks=4)
    old_entry = {k: v for k, v in ComputeConfig("tc", 128, 128, 0, 1, 8, 4).to_dict().items() if k != "chunks"}
    cache.write_text(json.dumps({cache_key("FakeGPU", layer, 1024): {"config": over.to_dict()},
                                 cache_key("FakeGPU", layer, 256): {"config": old_entry}}))
    assert tc.lookup(layer, 1000) == over and tc.lookup(layer, 1000).chunks == 4
    assert tc.lookup(layer, 200) == ComputeConfig("tc", 128, 128, 0, 1, 8, 4)
    assert tc.lookup(layer, 2000) == heuristic(layer, 2000)
    # a neighbour shape's entry stands in at M <= 16 only (large-M tiles depend on the layer's own wave count)
    near = LayerConfig(QuantSpec("int4"), 6144, 4096)
    cache.write_text(json.dumps({cache_key("FakeGPU", near, 4): {"config": tuned.to_dict()},
                                 cache_key("FakeGPU", near, 256): {"config": over.to_dict()}}))
    assert tc.lookup(layer, 4) == tuned and tc.lookup(layer, 256) == heuristic(layer, 256)


def test_packaged_cache_entries_are_valid():
    # every entry of the shipped H200 cache must parse and fit its own (format, N, K): a bad entry would be
    # skipped silently at run time
    from kestrel.kernels.configs import PACKAGED_CACHE, _config_of
    from kestrel.kernels.tuning import FORMATS
    names = {s.name: s for s in FORMATS.values()}
    entries = json.loads(PACKAGED_CACHE.read_text())
    assert entries
    for key, entry in entries.items():
        _, name, n, k, _ = key.split("|")
        layer = LayerConfig(names[name], int(n[1:]), int(k[1:]))
        assert _config_of(entry, layer) is not None, key


def test_heuristic_configs_are_valid():
    for spec in (QuantSpec("int4"), QuantSpec("fp4_e2m1", group_size=16, scale_dtype="fp8_e4m3", global_scale=True)):
        for n, k in ((4096, 4096), (57344, 8192), (64, 256), (1024, 14336)):
            layer = LayerConfig(spec, n, k)
            for m in (1, 4, 16, 64, 256, 4096):
                assert heuristic(layer, m).valid_for(layer)


def test_tune_cli_list_and_bad_shape(capsys):
    import argparse

    from kestrel.kernels import tune_cli
    p = argparse.ArgumentParser()
    tune_cli.add_parser(p.add_subparsers())
    assert tune_cli.run(p.parse_args(["tune", "--shape", "4096,4096", "--m", "1,16,64,256,1024,4096", "--list"])) == 0
    assert "measurements" in capsys.readouterr().out
    with pytest.raises(ValueError):
        tune_cli.run(p.parse_args(["tune", "--shape", "4096x4096", "--list"]))
    with pytest.raises(ValueError):
        tune_cli.run(p.parse_args(["tune", "--shape", "0,4096", "--list"]))


def test_tune_cache_nearest_shape(tmp_path, monkeypatch):
    cache = tmp_path / "tune.json"
    monkeypatch.setenv("KESTREL_TUNE_CACHE", str(cache))
    spec = QuantSpec("int4")
    tuned = ComputeConfig("gemv", 1, 256, 0, 4, 2, 3)
    cache.write_text(json.dumps({cache_key("G", LayerConfig(spec, 8192, 8192), 1): {"config": tuned.to_dict()}}))
    assert TuningConfig("G").lookup(LayerConfig(spec, 10240, 8192), 1) == tuned  # same shape class
    assert TuningConfig("G").lookup(LayerConfig(spec, 256, 512), 1) == heuristic(LayerConfig(spec, 256, 512), 1)
