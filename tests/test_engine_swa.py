"""Bounded SWA KV + replay in the engine (kestrel/engine/swa_kv.py) on tiny random HF checkpoints written here:
Mistral (every layer sliding), Qwen2 hybrid (full layer then sliding ones, from max_window_layers) and a
sliding/full/sliding stack (HF layer_types). References: transformers' logits and greedy tokens for the same
checkpoint, and the engine without any prefix cache. Also: SWA blocks held per sequence stay bounded by the
window, and the number of tokens run through the model on a prefix hit is the docstring's replay."""
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from parallel_helpers import record_logits, save_tiny  # noqa: E402

from kestrel.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from kestrel.model import load_model  # noqa: E402

W, BS = 8, 4
BASE = dict(vocab_size=512,  # ids below 512 are valid for the embedded tokenizer saved alongside
            hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
VARIANTS = {  # name -> (config class, model class, extra config, HF-independent list of sliding layers)
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=W), [0, 1, 2]),
    "qwen2-hybrid": ("Qwen2Config", "Qwen2ForCausalLM",
                     dict(use_sliding_window=True, sliding_window=W, max_window_layers=1), [1, 2]),
    "qwen2-sandwich": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        use_sliding_window=True, sliding_window=W,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]), [0, 2]),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    cfg_name, model_name, extra, swa = VARIANTS[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    torch.manual_seed(0)
    hf = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**{**BASE, **extra})).eval()
    save_tiny(hf, path)
    return path, hf, swa


def _engine(path, **kw):
    kw.setdefault("async_scheduling", False)  # _capture wraps runner.forward_step, which only the sync loop calls
    return LLMEngine(EngineConfig(model=path, block_size=BS, num_kv_blocks=96, progress=False, **kw))


def _capture(eng):
    """Logits of every engine step ([rows, vocab] each, in order) and the token count of every model call."""
    steps, calls = record_logits(eng), []
    eng.model.register_forward_pre_hook(lambda m, args: calls.append(args[0].numel()))
    return steps, calls


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _hf_greedy(hf, prompt, out):
    """transformers' greedy choice after each prefix of prompt + out (equal to `out` iff transformers would
    generate `out`; unlike generate(min_new_tokens=...) it does not suppress EOS, which ignore_eos lets through)."""
    return _hf_logits(hf, prompt + out)[len(prompt) - 1:-1].argmax(-1).tolist()


GREEDY = dict(temperature=0.0, ignore_eos=True)
gen = torch.Generator().manual_seed(3)
PREFIX = torch.randint(3, 512, (40,), generator=gen).tolist()  # 10 blocks, longer than the window
A = PREFIX + torch.randint(3, 512, (5,), generator=gen).tolist()
B = PREFIX + torch.randint(3, 512, (7,), generator=gen).tolist()


def test_config_layer_types_match_transformers(tiny):
    path, hf, swa = tiny
    c = load_model(path, progress=False).config
    assert c.swa_layers == swa
    assert [c.layer_window(i) for i in range(3)] == [W if i in swa else None for i in range(3)]
    if hasattr(hf.config, "layer_types") and hf.config.model_type != "mistral":
        assert [t == "sliding_attention" for t in hf.config.layer_types] == [i in swa for i in range(3)]


def test_prefix_hit_with_bounded_replay_is_exact(tiny):
    path, hf, swa = tiny
    n_new = 6
    eng = _engine(path, swa_replay_tokens=1)  # below the bound: the engine replays len(swa) * (W - 1)
    assert eng.swa_plan is not None and eng.swa_plan.replay_tokens == len(swa) * (W - 1)
    eng.generate([A], SamplingParams(max_tokens=3, **GREEDY))
    rows, calls = _capture(eng)
    out = eng.generate([B], SamplingParams(max_tokens=n_new, **GREEDY))[0]

    P = len(PREFIX)  # cached blocks shared with A
    S = (P - len(swa) * (W - 1)) // BS * BS  # replay start (module docstring)
    assert out.num_cached_tokens == S > 0
    assert calls[0] == len(B) - S  # the prefill step ran the replay (P - S tokens) plus B's own tokens
    assert eng.stats()["swa_replayed_tokens"] == P - S
    got = torch.cat(rows)

    full = B + out.output_token_ids
    ref = _hf_logits(hf, full)[len(B) - 1:len(full) - 1]
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    assert out.output_token_ids == ref.argmax(-1).tolist()  # = transformers' greedy continuation

    cold = _engine(path, enable_prefix_caching=False, swa_bounded_kv=False)  # full-length KV, every layer
    rows_c, _ = _capture(cold)
    out_c = cold.generate([B], SamplingParams(max_tokens=n_new, **GREEDY))[0]
    assert out_c.num_cached_tokens == 0 and out_c.output_token_ids == out.output_token_ids
    torch.testing.assert_close(got, torch.cat(rows_c), atol=1e-5, rtol=1e-5)


def test_swa_blocks_bounded_on_long_sequence(tiny):
    path, hf, swa = tiny
    n_new = 30
    eng = _engine(path, async_scheduling=True)  # SWA blocks are dropped while the previous step is in flight
    bm = eng.block_manager
    eng.add_request("r", A[:10], SamplingParams(max_tokens=n_new, **GREEDY))
    seq, held = eng.seqs["r"], []
    while eng.has_unfinished():
        eng.step()
        if not seq.is_finished:
            held.append(bm.swa_blocks_held(seq))
            assert bm.num_swa_blocks - 1 - len(bm.swa_free) == held[-1]  # the pool holds only this sequence's
    assert max(held[1:]) <= -(-W // BS) + 1  # decode steps: ceil((W - 1 + 1) / BS) + 1 blocks
    assert len(seq.token_ids) == 40 and max(held) < 40 // BS
    assert seq.output_token_ids == _hf_greedy(hf, A[:10], seq.output_token_ids)  # no key the window reads was dropped


def test_short_replay_warns_and_is_not_exact(tiny, caplog):
    path, hf, swa = tiny
    if len(swa) < 3:  # with two SWA layers the drift of these weights is real but below a robust threshold
        pytest.skip("needs three stacked SWA layers")
    with caplog.at_level(logging.WARNING, logger="kestrel.engine.swa_kv"):
        eng = _engine(path, swa_replay_tokens=W, swa_replay_exact=False)
    assert "below the exactness bound" in caplog.text and not eng.swa_plan.exact
    eng.generate([A], SamplingParams(max_tokens=1, **GREEDY))
    rows, calls = _capture(eng)
    eng.generate([B], SamplingParams(max_tokens=1, **GREEDY))
    assert calls[0] == len(B) - len(PREFIX) + W  # replayed W tokens (P - W is block-aligned)
    assert (rows[0][0] - _hf_logits(hf, B)[-1]).abs().max() > 1e-3  # the receptive field was cut: it drifts


def test_preemption_and_chunked_replay_stay_exact(tiny):
    """A cache too small for the batch (preemption, then recompute through the prefix cache + replay) and a
    token budget smaller than the replay (the replay spans several chunks)."""
    path, hf, swa = tiny
    if len(swa) != 2 or 0 in swa:
        pytest.skip("one variant is enough (hybrid: full layer first)")
    prompts = [A[:30], B[:33], A[:26] + B[40:], B[40:] + A[:28]]
    eng = LLMEngine(EngineConfig(model=path, block_size=BS, num_kv_blocks=24, max_num_batched_tokens=8,
                                 progress=False, swa_replay_tokens=1))
    outs = eng.generate(prompts, SamplingParams(max_tokens=12, **GREEDY))
    st = eng.stats()
    assert st["num_preemptions"] > 0 and st["swa_replayed_tokens"] > 0
    assert [o.output_token_ids for o in outs] == [_hf_greedy(hf, p, o.output_token_ids) for p, o in zip(prompts, outs)]
    assert st["swa_kv_blocks_used"] == 0  # everything went back to the pool
