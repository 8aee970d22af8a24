"""Prefill/decode disaggregation over torch.distributed point-to-point (gloo on the CPU standing in for NCCL
between GPUs): rank 0 prefills a prompt and sends its KV blocks, rank 1 imports them and decodes. The decode
rank's greedy continuation must equal a single engine's, and its prefix-cache hits must show the received
blocks were used rather than recomputed."""
from parallel_helpers import make_tiny_llama, run_ranks

from kestrel.engine import EngineConfig, LLMEngine, SamplingParams

PROMPT = list(range(1, 40))  # 39 tokens: two full blocks travel, the tail (and last token) is recomputed
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _config(path):
    return EngineConfig(model=path, dtype="float32", num_kv_blocks=32, block_size=16, progress=False)


def _pd_rank(rank, world, init_method, path):
    from kestrel.engine.kv_transfer_nccl import recv_prefix_blocks, send_prefix_blocks
    from kestrel.model.parallel import destroy_distributed, init_distributed

    init_distributed(rank, world, init_method)
    engine = LLMEngine(_config(path))
    try:
        if rank == 0:  # prefill leg: compute the prompt's KV (one token), ship the full blocks
            engine.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            return send_prefix_blocks(engine, PROMPT, dst=1)
        held = recv_prefix_blocks(engine, src=0)
        out = engine.generate([PROMPT], GREEDY)[0].output_token_ids
        return held, out, engine.stats()["prefix_cache_hits"]
    finally:
        destroy_distributed()


def test_pd_kv_blocks_over_point_to_point(tmp_path):
    make_tiny_llama(str(tmp_path), seed=5)
    ref = LLMEngine(_config(str(tmp_path))).generate([PROMPT], GREEDY)[0].output_token_ids
    res = run_ranks(_pd_rank, 2, str(tmp_path))
    sent, (held, out, hits) = res[0], res[1]
    assert sent == 2 and held == 2
    assert hits == 32  # the decode engine found both received blocks in its prefix cache
    assert out == ref
