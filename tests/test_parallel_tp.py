"""Tensor parallelism on the CPU: TP=2 over gloo (two forked ranks on loopback) against TP=1 on the same tiny
random Llama checkpoints. Greedy output must be token-identical and every step's logits close; the shards
themselves are checked against the unsharded layers (column slices, row partial sums, packed QuantLinear)."""
import pytest
import torch
from parallel_helpers import make_tiny_llama, record_logits, run_ranks
from torch import nn

from kestrel.engine import EngineConfig, LLMEngine, SamplingParams
from kestrel.model.config import ModelConfig
from kestrel.model.parallel import column_shard, heads_per_rank, row_shard

PROMPTS = [[1, 504, 308, 314, 725, 30, 253, 789], [1, 47, 990, 19, 31], [1, 887, 314, 260, 130, 282, 406] * 3]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

VARIANTS = {
    # untied head, attention bias (row-parallel bias added once), 2 KV heads split over 2 ranks
    "untied-bias-gqa": dict(attention_bias=True, vocab_size=1001),  # odd vocab: the last shard is padded
    # tied embeddings (vocab-parallel head shares the embedding shard), 1 KV head replicated on both ranks
    "tied-kv-replicated": dict(tie_word_embeddings=True, num_key_value_heads=1),
}


def _config(path, **kw):
    # synchronous: the single-rank reference records logits by wrapping runner.forward_step (async skips it)
    return EngineConfig(model=path, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16, progress=False,
                        async_scheduling=False, **kw)


def _generate(engine):
    seen = record_logits(engine)  # rank 0 / the TP=1 engine
    outs = engine.generate(PROMPTS, GREEDY)
    return [o.output_token_ids for o in outs], seen


def _tp_rank(rank, world, init_method, config):
    from kestrel.engine.tp_worker import run_rank
    return run_rank(rank, world, config, init_method, driver=_generate)


def _launched(rank, world, init_method, config, tp):
    """The serving path: this process becomes rank 0 and starts the other ranks itself."""
    from kestrel.engine.tp_worker import launch_tp_engine

    engine = launch_tp_engine(config, tp, start_method="fork")
    try:
        return _generate(engine)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny_llama(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    make_tiny_llama(path, **VARIANTS[request.param])
    return request.param, path


def test_tp2_greedy_matches_tp1(tiny_llama):
    # max_num_batched_tokens=16 chunks the 21-token prompt, so chunked prefill and mixed batches run under TP too
    variant, path = tiny_llama
    config = _config(path)
    ref_tokens, ref_logits = _generate(LLMEngine(config))
    if variant == "untied-bias-gqa":
        tp_tokens, tp_logits = run_ranks(_tp_rank, 2, config)[0]
    else:  # through launch_tp_engine, as `kestrel serve --tensor-parallel-size 2` starts it
        tp_tokens, tp_logits = run_ranks(_launched, 1, config, 2)[0]
    assert tp_tokens == ref_tokens
    assert len(tp_logits) == len(ref_logits)
    for a, b in zip(tp_logits, ref_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_tp2_quantized_shards_match_tp1(tmp_path):
    # quantize-on-load first, then shard the packed QuantLinear weights (per-channel int8: row shards share scales)
    # K of every split must stay a whole packed block (64 for 8-bit codes): hidden 128, o_proj 128, down 128
    make_tiny_llama(str(tmp_path), attention_bias=True, hidden_size=128, intermediate_size=128,
                    num_hidden_layers=1)
    config = _config(str(tmp_path), quantization="int8")
    ref_tokens, ref_logits = _generate(LLMEngine(config))
    tp_tokens, tp_logits = run_ranks(_tp_rank, 2, config)[0]
    assert tp_tokens == ref_tokens
    for a, b in zip(tp_logits, ref_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_unsplittable_tp_size_is_a_clear_error(tmp_path):
    make_tiny_llama(str(tmp_path))  # 4 heads cannot split 3 ways
    with pytest.raises(AssertionError, match="ValueError: 4 attention heads cannot be split"):
        run_ranks(_launched, 1, _config(str(tmp_path)), 3)


def _linear(n, k, bias=True):
    torch.manual_seed(1)
    m = nn.Linear(k, n, bias=bias)
    m.bias.data.normal_() if bias else None
    return m


def test_column_and_row_shards_of_linear():
    m, x = _linear(24, 32), torch.randn(5, 32)
    full = m(x)
    segs = [(0, 4), (16, 20)]
    torch.testing.assert_close(column_shard(m, segs)(x), torch.cat([full[:, 0:4], full[:, 16:20]], -1))
    parts = sum(row_shard(m, a, a + 16)(x[:, a:a + 16]) for a in (0, 16))
    torch.testing.assert_close(parts + m.bias, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", ["int4-g32", "uint4-g32-zp", "int8-channel"])
def test_quantlinear_shards_are_exact_slices(scheme):
    from kestrel.kernels.quant_linear import QuantLinear
    from kestrel.quant.spec import QuantSpec
    from kestrel.quant.weight import dequantize

    spec = {"int4-g32": QuantSpec(weight_dtype="int4", act_dtype="bf16", group_size=32),
            "uint4-g32-zp": QuantSpec(weight_dtype="uint4", act_dtype="bf16", group_size=32, has_zero_point=True),
            "int8-channel": QuantSpec(weight_dtype="int8", act_dtype="bf16", group_size=-1)}[scheme]
    q = QuantLinear.from_float(_linear(48, 256), spec)
    w = dequantize(q.qweight_struct)  # independent reference: the unsharded weight, dequantized
    col = column_shard(q, [(8, 16), (32, 40)])
    torch.testing.assert_close(dequantize(col.qweight_struct), torch.cat([w[8:16], w[32:40]]), rtol=0, atol=0)
    torch.testing.assert_close(col.bias, torch.cat([q.bias[8:16], q.bias[32:40]]))
    row = row_shard(q, 128, 256)  # 128 = one packed K block of 4-bit codes
    torch.testing.assert_close(dequantize(row.qweight_struct), w[:, 128:256], rtol=0, atol=0)
    x = torch.randn(3, 256)
    y = row_shard(q, 0, 128)(x[:, :128]) + row(x[:, 128:]) + q.bias
    torch.testing.assert_close(y, q(x), rtol=1e-4, atol=1e-4)


def test_bad_splits_raise_clear_errors():
    from kestrel.kernels.quant_linear import QuantLinear
    from kestrel.quant.spec import QuantSpec

    cfg = ModelConfig(hidden_size=64, intermediate_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=8)
    assert heads_per_rank(cfg, 3) == (2, 1)
    assert heads_per_rank(ModelConfig(num_attention_heads=8, num_key_value_heads=2, intermediate_size=64), 4) == (2, 1)
    with pytest.raises(ValueError, match="attention heads"):
        heads_per_rank(cfg, 4)
    with pytest.raises(ValueError, match="KV heads"):
        heads_per_rank(ModelConfig(num_attention_heads=12, num_key_value_heads=3, intermediate_size=96), 2)
    q = QuantLinear.from_float(_linear(16, 128), QuantSpec(weight_dtype="int4", act_dtype="bf16", group_size=64))
    with pytest.raises(ValueError, match="not aligned"):
        row_shard(q, 0, 32)


def test_cli_has_tensor_parallel_flag():
    import argparse

    from kestrel.commands.engine_args import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args(["--tensor-parallel-size", "2"]).tensor_parallel_size == 2
    assert "--tensor-parallel-size" in p.format_help()
