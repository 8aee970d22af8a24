"""The padded prefill step behind the engine's prefill CUDA graphs (kestrel/engine/prefill_graphs.py), run on the
CPU without capture: the last token's logits of padded chunks (a fresh prompt and a chunk on top of cached
context) against the eager paged prefill, K/V written only at the real slots, the result independent of the
padding's contents, and the engine's greedy output (no-spec and a draft head, lone and chunked prefills) through
the padded path token-identical to the eager prefill. The Triton kernels run interpreted (TRITON_INTERPRET=1)."""
import os
from types import SimpleNamespace

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


@interp
def test_self_check_keeps_sound_buckets_and_restores_kv():
    """The capture-time self-check (prefill_graph_check.py) on a sound padded step: every bucket passes (logits,
    hidden state and the chunk's K/V match the eager prefill) and the KV blocks it borrowed hold what they held."""
    e = _engine()
    for t in (*e.runner.backend.k_cache, *e.runner.backend.v_cache):
        t.normal_()  # stale contents that must survive the check
    before = [t.clone() for t in (*e.runner.backend.k_cache, *e.runner.backend.v_cache)]
    e.runner.enable_prefill_graphs(e.max_model_len, buckets=(4, 8, 16), capture=False)
    rep = e.runner.prefill_graph_report
    assert rep["kept"] == [4, 8, 16] and all(r["ok"] and r["kv_ok"] for r in rep["check"].values())
    assert all(r["logit_diff"] < 1e-4 for r in rep["check"].values())
    after = [*e.runner.backend.k_cache, *e.runner.backend.v_cache]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert e.runner.prefill_graphs.num_runs == 0


@interp
def test_self_check_drops_a_mismatching_bucket_and_falls_back(reference, caplog):
    """A forced mismatch: the eager reference disagrees for bucket 8's warm-up chunk (5 tokens): bucket 8 is dropped,
    logged once, the other buckets kept; the engine's greedy output stays identical to the eager engine (chunks of
    5-8 tokens now pad to 16)."""
    e = _engine()
    eager = e.runner._eager_prefill

    def faulty(ids, start, table):
        logits, hidden = eager(ids, start, table)
        return (logits + 1.0, hidden) if len(ids) == 5 else (logits, hidden)
    with caplog.at_level("WARNING", logger="kestrel.engine.prefill_graph_check"):
        e.runner.enable_prefill_graphs(e.max_model_len, buckets=(4, 8, 16, 64), capture=False, eager=faulty)
    rep = e.runner.prefill_graph_report
    assert rep["kept"] == [4, 16, 64] and not rep["check"][8]["ok"] and rep["check"][8]["logit_diff"] >= 0.99
    assert sum("dropped" in r.getMessage() for r in caplog.records) == 1
    assert e.runner.prefill_graphs.bucket(6) == 16
    assert _one_by_one(e) == reference
    assert e.runner.prefill_graphs.num_runs >= len(PROMPTS)


@interp
def test_self_check_catches_a_faulty_padded_step():
    """Faults in the padded step itself: a step that stores K/V one slot off (bucket 8) and one that raises
    (bucket 16) are both dropped; with no bucket left the runner keeps no prefill graphs (eager prefill)."""
    from kestrel.engine.prefill_graph_check import check_prefill_graphs
    e = _engine()
    r = e.runner
    pg = PrefillCudaGraphs(r.model, r.backend.k_cache, r.backend.v_cache, 32, buckets=(4, 8, 16), capture=False)
    step = pg._step

    def faulty(S):
        if S == 16:
            raise RuntimeError("replay failed")
        if S == 8:
            sm = pg.slot_mapping[:S]
            sm.copy_(torch.where(sm >= 0, sm + 1, sm))
        return step(S)
    pg._step = faulty
    rep = check_prefill_graphs(pg, r._eager_prefill, SHAPE["vocab_size"])
    assert rep[4]["ok"] and not rep[8]["ok"] and rep[8]["kv_ok"] is False
    assert not rep[16]["ok"] and "replay failed" in rep[16]["error"]
    assert pg.buckets == [4] and not pg.fits(5, 2) and pg.fits(4, 1)
    pg.drop([4])
    assert not pg.fits(1, 1)
    calls = []
    r.enable_prefill_graphs(e.max_model_len, buckets=(4,), capture=False,
                            eager=lambda *a: calls.append(1) or (_ for _ in ()).throw(RuntimeError("no eager")))
    assert calls and r.prefill_graphs is None and r.prefill_graph_report["kept"] == []
    assert not r.prefill_graph_fits(SimpleNamespace(block_table=[0]), 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="graph capture needs CUDA")
def test_self_check_passes_on_captured_graphs_cuda():
    """GPU: the captured graphs (bf16) pass their self-check in every bucket, and the engine's first tokens through
    them equal the eager prefill's (same engine, graphs switched off)."""
    e = _engine(device="cuda", dtype="bfloat16", cuda_graphs=True)
    e.runner.enable_prefill_graphs(e.max_model_len, buckets=(4, 8, 16, 64))
    rep = e.runner.prefill_graph_report
    assert rep["kept"] == [4, 8, 16, 64] and not rep["capture_errors"], rep
    assert all(r["ok"] for r in rep["check"].values()), rep
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    graph = [e.generate(p, first)[0].output_token_ids for p in PROMPTS]
    assert e.runner.prefill_graphs.num_runs >= len(PROMPTS)
    e.runner.use_prefill_graphs = False
    assert graph == [e.generate(p, first)[0].output_token_ids for p in PROMPTS]
