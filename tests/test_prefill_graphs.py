"""The padded prefill step behind the engine's prefill CUDA graphs (kestrel/engine/prefill_graphs.py), run on the
CPU without capture: the last token's logits of padded chunks (a fresh prompt and a chunk on top of cached
context) against the eager paged prefill, K/V written only at the real slots, the result independent of the
padding's contents, and the engine's greedy output (no-spec and a draft head, lone and chunked prefills) through
the padded path token-identical to the eager prefill. The Triton kernels run interpreted (TRITON_INTERPRET=1)."""
import os

import pytest
import torch

import kestrel.spec  # noqa: F401
from kestrel.engine.attention import TorchAttentionBackend, build_metadata
from kestrel.engine.llm_engine import LLMEngine
from kestrel.engine.model_runner import ForwardContext, prompt_logits
from kestrel.engine.prefill_graphs import PrefillCudaGraphs
from kestrel.engine.sampling_params import SamplingParams

interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                            reason="the Triton attention kernels need TRITON_INTERPRET=1 on a CPU")

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
PROMPTS = ["1 2 3 4 5 1 2 3 4 5 1 2", "9 8 7 6", "0 0 1 1 2 2 0 0 1 1 2 2 0 0 1 1 3 3", "3 1 4 1 5 9 2 6"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _model(device="cpu", dtype=torch.float32):
    from kestrel.model.dummy import build_dummy_model, dummy_config
    cfg, _ = dummy_config(SHAPE)
    return build_dummy_model(cfg, dtype=dtype, device=device, seed=0).requires_grad_(False)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=interp), pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="graph capture needs CUDA"))])
def test_padded_prefill_matches_eager(device):
    """A fresh 11-token prompt (bucket 16) and a 5-token chunk on top of 7 cached tokens (bucket 8): the last
    token's logits equal a full eager forward's, K/V land exactly at the real slots (padding stores nothing), and
    other padding tokens / stale cache contents after the chunk leave the logits bit-identical."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = _model(device, dtype)
    c, blk = model.config, 4
    be = TorchAttentionBackend(c.num_hidden_layers, 32, blk, c.num_attention_heads, c.num_key_value_heads,
                               c.head_dim, dtype, device)
    pg = PrefillCudaGraphs(model, be.k_cache, be.v_cache, max_blocks_per_seq=8, buckets=(8, 16),
                           capture=device == "cuda")
    pg.capture()
    g = torch.Generator().manual_seed(1)
    fresh = torch.randint(1, 256, (11,), generator=g).tolist()
    t_fresh = [5, 2, 9]  # blocks of the fresh prompt
    chunked = torch.randint(1, 256, (12,), generator=g).tolist()
    t_chunk = [7, 1, 3]
    meta, positions = build_metadata([], [(0, 7, t_chunk)], blk, None, device)  # cache the first 7 tokens eagerly
    with torch.inference_mode():
        model(torch.tensor(chunked[:7], device=device), torch.tensor(positions, device=device), ForwardContext(be, meta))
    for toks, start, table in [(fresh, 0, t_fresh), (chunked, 7, t_chunk)]:
        before = [k.clone() for k in be.k_cache]
        logits, hid = pg.run(toks[start:], start, table)
        logits, hid = logits.clone(), hid.clone()
        ref = prompt_logits(model, toks)[-1:]
        assert logits.shape == (1, 256) and hid.shape == (1, SHAPE["hidden_size"])
        if device == "cpu":
            torch.testing.assert_close(logits.float(), ref, rtol=1e-4, atol=1e-4)
        else:  # bf16: different kernels round differently
            assert (logits.float() - ref).abs().max() <= 0.03 * ref.abs().max() + 1e-2
        assert logits.argmax(-1).tolist() == ref.argmax(-1).tolist()
        for k0, k1 in zip(before, be.k_cache):  # K/V written exactly at the chunk's positions, nowhere else
            changed = (k0 != k1).flatten(2).any(-1).view(-1).nonzero().flatten().tolist()
            want = sorted(table[p // blk] * blk + p % blk for p in range(start, len(toks)))
            assert changed == want
        # leak check: other padding token ids and garbage in the cache after the chunk change nothing
        end = len(toks)
        for k, v in zip(be.k_cache, be.v_cache):
            for p in range(end, len(table) * blk):
                k[table[p // blk], p % blk].fill_(7.0)
                v[table[p // blk], p % blk].fill_(-5.0)
        again, hid2 = pg.run(toks[start:], start, table, pad_token=123)
        assert torch.equal(again, logits) and torch.equal(hid2, hid)
    assert pg.num_runs == 4


def _engine(spec=None, **kw):
    args = dict(load_format="dummy", model_shape=SHAPE, num_kv_blocks=96, block_size=4, progress=False,
                max_num_seqs=8, speculative=spec)
    args.update(kw)
    return LLMEngine(**args)


def _one_by_one(e):
    """Each prompt alone (the lone prefills the graphs serve), greedy."""
    return [e.generate(p, GREEDY)[0].output_token_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def reference():
    return _one_by_one(_engine())


@interp
@pytest.mark.parametrize("chunk", [None, 4])
@pytest.mark.parametrize("spec", ["none", "head"])
def test_engine_greedy_identical_through_padded_prefill(reference, tmp_path, spec, chunk):
    """No-spec (the runner's step) and a draft head (the speculative step's prefill, which keeps the last hidden
    state for the head) with the padded prefill: tokens equal the eager engine's; chunk=4: chunked prefills
    (chunks on top of cached context) take the padded path too."""
    cfg = None
    if spec == "head":
        from kestrel.spec.draft_head import DraftHead
        f = tmp_path / "head.safetensors"
        torch.manual_seed(0)
        DraftHead(SHAPE["hidden_size"], k=3, recurrent=True).save(str(f))
        cfg = f"drafter=head,head={f},k=3,schedule=fixed,loop=on"
    e = _engine(cfg, **({"max_num_batched_tokens": chunk} if chunk else {}))
    e.runner.enable_prefill_graphs(e.max_model_len, buckets=(4, 8, 16, 32, 64), capture=False)
    assert _one_by_one(e) == reference
    pg = e.runner.prefill_graphs
    assert pg.num_runs >= len(PROMPTS) * (2 if chunk else 1)  # the padded path served the prefills
    s = e.stats()
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"]
    if spec == "head":
        assert s["spec_num_accepted_tokens"] >= 0 and e.spec.num_spec_steps > 0
