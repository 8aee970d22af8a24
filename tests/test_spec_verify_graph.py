"""The padded verify step behind the CUDA-graph path (kestrel/spec/verify_graph.py), run on the CPU without
capture: host metadata against the KV-layout contract, logits of padded chunks against a full recompute of each
sequence, and the engine's greedy output through the padded path token-identical to plain decoding.
The Triton kernels run interpreted (TRITON_INTERPRET=1, as the test suite runs)."""
import os

import pytest
import torch

import kestrel.spec  # noqa: F401
from kestrel.engine.attention import TorchAttentionBackend, build_metadata
from kestrel.engine.llm_engine import LLMEngine
from kestrel.engine.model_runner import ForwardContext, prompt_logits
from kestrel.engine.sampling_params import SamplingParams
from kestrel.spec.verify_graph import VerifyGraphs, pack_verify_inputs

interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                            reason="the Triton attention kernels need TRITON_INTERPRET=1 on a CPU")

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
PROMPTS = ["1 2 3 4 5 1 2 3 4 5 1 2", "9 8 7 6", "0 0 1 1 2 2 0 0 1 1", "3 1 4 1 5 9 2 6", "1 2 3 4 5 1 2 3 4"]


def test_pack_verify_inputs_layout():
    bs_blk = 4
    rows = [(7, [8, 9], 5, [3, 1]), (11, [], 2, [0])]  # (last token, drafts, cached context, block table)
    ids, pos, slots, seq_lens, bt = pack_verify_inputs(rows, K=3, bs=4, block_size=bs_blk)
    S = 4
    assert ids.view(4, S).tolist()[:2] == [[7, 8, 9, 0], [11, 0, 0, 0]]
    assert ids.view(4, S)[2:].eq(0).all()
    # real tokens at their positions; slot = table[pos // block] * block + pos % block (CONTRACTS)
    assert pos.view(4, S)[0, :3].tolist() == [5, 6, 7] and pos.view(4, S)[1, 0].item() == 2
    assert slots.view(4, S)[0].tolist() == [1 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3, -1]
    assert slots.view(4, S)[1].tolist() == [0 * 4 + 2, -1, -1, -1]
    assert slots.view(4, S)[2:].eq(-1).all()  # padding rows store nothing
    # query j sits at seq_len - S + j: real queries at their true positions; padding rows attend nothing
    assert seq_lens.tolist() == [5 + S, 2 + S, 0, 0]
    assert bt.tolist() == [[3, 1], [0, 0]]
    with pytest.raises(ValueError):
        pack_verify_inputs(rows, K=1, bs=4, block_size=bs_blk)  # 2 drafts > K


def _model(device="cpu", dtype=torch.float32):
    # built directly: load_model would also load the embedded model's tokenizer, absent on a bare GPU machine
    from kestrel.model.dummy import build_dummy_model, dummy_config
    cfg, _ = dummy_config(SHAPE)
    return build_dummy_model(cfg, dtype=dtype, device=device, seed=0).requires_grad_(False)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=interp), pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="graph capture needs CUDA"))])
def test_padded_verify_logits_match_full_recompute(device):
    """Three sequences with 0, 1 and 3 drafts in a (4 rows, K=4) shape: each real row's logits equal the
    logits of a from-scratch forward over the whole sequence; padding stores no K/V. On CUDA through captured
    graphs (bf16: tolerance), replayed twice."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = _model(device, dtype)
    c, blk = model.config, 4
    be = TorchAttentionBackend(c.num_hidden_layers, 32, blk, c.num_attention_heads, c.num_key_value_heads,
                               c.head_dim, dtype, device)
    g = torch.Generator().manual_seed(1)
    ctxs = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (6, 9, 13)]
    drafts = [[], [5], [17, 3, 99]]
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9, 10]]
    # cache each context except its last token (the verify chunk starts with it)
    meta, positions = build_metadata([], [(0, len(t) - 1, tb) for t, tb in zip(ctxs, tables)], blk, None, device)
    ids = torch.tensor([x for t in ctxs for x in t[:-1]], device=device)
    with torch.inference_mode():
        model(ids, torch.tensor(positions, device=device), ForwardContext(be, meta))
    before = [k.clone() for k in be.k_cache]
    vg = VerifyGraphs(model, be.k_cache, be.v_cache, batch_sizes=[2, 4], k_sizes=[1, 4], max_blocks_per_seq=6,
                      capture=device == "cuda")
    vg.capture()
    rows = [(t[-1], d, len(t) - 1, tb) for t, d, tb in zip(ctxs, drafts, tables)]
    for _ in range(2 if device == "cuda" else 1):  # replays rewrite the same slots with the same values
        logits, top, hidden = vg.run(rows)
        assert logits.shape == (3, 5, 256) and top.shape == (3, 5)
        for r, (t, d) in enumerate(zip(ctxs, drafts)):
            ref = prompt_logits(model, t + d)[len(t) - 1:]  # positions of the last token and each draft
            got = logits[r, :len(d) + 1].float()
            if device == "cpu":
                torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
                assert top[r, :len(d) + 1].tolist() == ref.argmax(-1).tolist()
            else:  # bf16: different kernels round differently
                assert (got - ref).abs().max() <= 0.03 * ref.abs().max() + 1e-2
    # K/V written exactly at the real chunk positions, nowhere else
    for layer, (k0, k1) in enumerate(zip(before, be.k_cache)):
        changed = (k0 != k1).flatten(2).any(-1).view(-1).nonzero().flatten().tolist()
        want = sorted(tb[p // blk] * blk + p % blk for t, d, tb in zip(ctxs, drafts, tables)
                      for p in range(len(t) - 1, len(t) + len(d)))
        assert changed == want, layer


def _engine(spec, **kw):
    args = dict(load_format="dummy", model_shape=SHAPE, num_kv_blocks=96, block_size=4, progress=False,
                max_num_seqs=8, speculative=spec)
    args.update(kw)
    return LLMEngine(**args)


def _padded(engine, k_sizes=(1, 2, 4)):
    """Route the engine's all-decode speculative steps through the padded verify step (no capture on a CPU)."""
    b = engine.runner.backend
    vg = VerifyGraphs(engine.model, b.k_cache, b.v_cache, [1, 2, 4, 8], list(k_sizes),
                      -(-engine.max_model_len // engine.runner.block_size), capture=False)
    calls = []
    run = vg.run
    vg.run = lambda rows, K=None: calls.append(len(rows)) or run(rows, K)
    engine.spec.graphs = vg
    return calls


@pytest.fixture(scope="module")
def reference():
    e = _engine(None)
    outs = e.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    return [o.output_token_ids for o in outs]


@interp
def test_engine_greedy_identical_through_padded_verify(reference):
    """Confidence-scheduled n-gram drafts: rows of 0..4 drafts in one step, K buckets 1, 2 and 4 all used."""
    e = _engine("drafter=ngram,k=4")
    calls = _padded(e)
    outs = e.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert [o.output_token_ids for o in outs] == reference
    s = e.stats()
    assert calls and s["spec_num_accepted_tokens"] > 0  # the padded path ran and accepted drafts
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"]


@interp
def test_padded_verify_sampling_and_logprobs(reference):
    """Rows that sample or ask for logprobs take the general verification on the padded logits."""
    e = _engine("drafter=ngram,k=4")
    calls = _padded(e)
    params = [SamplingParams(max_tokens=14, temperature=0.8, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.7, presence_penalty=0.5, ignore_eos=True)]
    outs = e.generate(PROMPTS[:3], params)
    assert calls
    assert [len(o.output_token_ids) for o in outs] == [14, 16, 9]
    assert outs[1].output_token_ids == reference[1]
    assert all(0 <= t < SHAPE["vocab_size"] for o in outs for t in o.output_token_ids)
    assert e.stats()["num_free_kv_blocks"] == e.stats()["num_kv_blocks"]


def _stream_logprobs(e, params):
    for i, p in enumerate(params):
        e.add_request(f"r{i}", PROMPTS[i], p)
    got: dict[str, list] = {}
    while e.has_unfinished():
        for o in e.step():
            got.setdefault(o.request_id, []).extend(o.logprobs or [])
    return [got[f"r{i}"] for i in range(len(params))]


@interp
@pytest.mark.parametrize("padded", [True, False])
def test_spec_logprobs_match_plain_values(padded):
    """Batched logprobs of verified rows (one gather + one topk per distinct n) against the plain engine's sampler:
    same chosen-token logprob and top-n per emitted token, rows with logprobs=0 and =2 in one step."""
    params = [SamplingParams(max_tokens=12, temperature=0, logprobs=n, ignore_eos=True) for n in (2, 0, 2)]
    ref = _stream_logprobs(_engine(None), params)
    e = _engine("drafter=ngram,k=4")
    calls = _padded(e) if padded else []
    outs = _stream_logprobs(e, params)
    assert e.stats()["spec_num_accepted_tokens"] > 0 and bool(calls) == padded
    for o, r, p in zip(outs, ref, params):
        assert len(o) == len(r) == p.max_tokens
        for got, want in zip(o, r):
            assert got["token_id"] == want["token_id"] and abs(got["logprob"] - want["logprob"]) < 1e-4
            assert list(got["top"]) == list(want["top"]) and len(got["top"]) == p.logprobs
            assert all(abs(got["top"][t] - v) < 1e-4 for t, v in want["top"].items())


def test_pack_verify_inputs_numpy_path_matches_row_path():
    """Past 16 rows the packing is vectorised: same tensors as packing the same rows in chunks of <= 16 (the
    per-row path, checked against the layout contract above), ragged drafts and block tables."""
    import random
    rnd = random.Random(0)
    for K, n in [(1, 17), (4, 40), (4, 64)]:
        rows = []
        for _ in range(n):
            k, ctx = rnd.randint(0, K), rnd.randint(1, 90)
            table = [rnd.randint(0, 60) for _ in range(-(-(ctx + k + 1) // 4) + rnd.randint(0, 2))]
            rows.append((rnd.randint(0, 255), [rnd.randint(0, 255) for _ in range(k)], ctx, table))
        ids, pos, slots, seq_lens, bt = pack_verify_inputs(rows, K, n + 3, 4)
        S, nb = K + 1, bt.shape[1]
        for a in range(0, n, 16):
            part = rows[a:a + 16]
            p_ids, p_pos, p_slots, p_lens, p_bt = pack_verify_inputs(part, K, len(part), 4)
            sl = slice(a * S, (a + len(part)) * S)
            assert torch.equal(ids[sl], p_ids) and torch.equal(pos[sl], p_pos) and torch.equal(slots[sl], p_slots)
            assert torch.equal(seq_lens[a:a + len(part)], p_lens)
            assert torch.equal(bt[a:a + len(part), :p_bt.shape[1]], p_bt) and not bt[a:a + len(part), p_bt.shape[1]:].any()
        assert ids.dtype == pos.dtype == slots.dtype == torch.long and seq_lens.dtype == bt.dtype == torch.int32
        assert not ids[n * S:].any() and (slots[n * S:] == -1).all() and not seq_lens[n:].any() and nb >= 1
