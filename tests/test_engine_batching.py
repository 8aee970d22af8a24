"""Engine behaviour on a tiny random Llama checkpoint: batched + paged + prefix-cached + chunked-prefill generation
under forced preemption gives the same greedy tokens as one request at a time; abort frees blocks; prefix cache
counters; stop strings / stop token ids / max_tokens; request validation."""
import pytest

from kestrel.engine import EngineConfig, LLMEngine, SamplingParams
from test_model_hf_tiny import make_tiny_checkpoint

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    make_tiny_checkpoint(path, "llama-tied-linear-rope", seed=1)
    return path


def engine(path, **kw):
    return LLMEngine(EngineConfig(model=path, progress=False, **kw))


SHARED = [1, 504, 3108, 314, 2725, 30, 253, 1789, 28, 2887, 314, 260, 1130]  # 13-token common prefix


def prompts():
    out = []
    for i in range(8):
        suffix = [100 + 7 * i + j for j in range(3 + 2 * i)]
        out.append((SHARED if i % 2 == 0 else SHARED[:6]) + suffix)
    return out


@pytest.fixture(scope="module")
def reference(ckpt):
    """One request at a time, roomy cache, no prefix caching, whole prompt in one step."""
    eng = engine(ckpt, block_size=4, num_kv_blocks=256, enable_prefix_caching=False, max_num_batched_tokens=4096)
    return [eng.generate([p], SamplingParams(max_tokens=14, **GREEDY))[0].output_token_ids for p in prompts()]


def test_batched_paged_prefix_cached_preempted_equals_sequential(ckpt, reference):
    # 20 blocks x 4 tokens = 80 slots for 8 requests needing up to ~45 each: preemption is forced;
    # a 12-token budget forces chunked prefill; half the requests arrive while others are decoding.
    eng = engine(ckpt, block_size=4, num_kv_blocks=20, max_num_batched_tokens=12, max_num_seqs=6)
    ps = prompts()
    params = SamplingParams(max_tokens=14, **GREEDY)
    got = {}
    for i in range(4):
        eng.add_request(str(i), ps[i], params)
    steps = 0
    while eng.has_unfinished() or len(got) < len(ps):
        if steps == 3:
            for i in range(4, 8):
                eng.add_request(str(i), ps[i], params)
        for out in eng.step():
            if out.finished:
                got[int(out.request_id)] = out.output_token_ids
        steps += 1
        assert steps < 2000
    assert [got[i] for i in range(len(ps))] == reference
    st = eng.stats()
    assert st["num_preemptions"] > 0
    assert st["prefix_cache_hits"] > 0
    assert st["num_free_kv_blocks"] == 20 and st["num_running"] == 0 and st["num_waiting"] == 0


def test_prefix_cache_hits_rise_on_repeats(ckpt, reference):
    eng = engine(ckpt, block_size=4, num_kv_blocks=64)
    p = prompts()[0]  # 16 tokens
    params = SamplingParams(max_tokens=14, **GREEDY)
    first = eng.generate([p], params)[0]
    h0 = eng.stats()["prefix_cache_hits"]
    assert h0 == 0
    second = eng.generate([p], params)[0]
    h1 = eng.stats()["prefix_cache_hits"]
    assert h1 - h0 == (len(p) - 1) // 4 * 4  # every full block but the one holding the last prompt token
    assert second.num_cached_tokens == h1 - h0
    assert first.output_token_ids == second.output_token_ids == reference[0]
    # a prompt that shares only the first 6 tokens hits one block
    eng.generate([prompts()[1]], params)
    assert eng.stats()["prefix_cache_hits"] - h1 == 4


def test_abort_frees_blocks(ckpt):
    eng = engine(ckpt, block_size=4, num_kv_blocks=64, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=50, **GREEDY)
    eng.add_request("a", prompts()[0], params)
    eng.add_request("b", prompts()[1], params)
    for _ in range(3):
        eng.step()
    used_b = len(eng.seqs["b"].block_table)
    assert eng.abort_request("a")
    assert eng.stats()["num_free_kv_blocks"] == 64 - used_b
    assert eng.stats()["num_running"] == 1
    assert eng.abort_request("b")
    assert eng.stats()["num_free_kv_blocks"] == 64 and not eng.has_unfinished()
    assert not eng.abort_request("b")  # unknown id: no error


def test_stop_string_trims_text(ckpt):
    eng = engine(ckpt, block_size=4, num_kv_blocks=64)
    p = prompts()[2]
    full = eng.generate([p], SamplingParams(max_tokens=14, **GREEDY))[0]
    text = full.text
    assert len(text) > 6
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = text.find(stop)
    out = eng.generate([p], SamplingParams(max_tokens=14, stop=[stop], **GREEDY))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:cut]
    # streamed deltas add up to the final text and never show part of the stop string
    eng.add_request("s", p, SamplingParams(max_tokens=14, stop=[stop], **GREEDY))
    deltas = []
    while eng.has_unfinished():
        deltas += [o.new_text for o in eng.step()]
    assert "".join(deltas) == text[:cut]


def test_stop_token_ids_and_max_tokens(ckpt, reference):
    eng = engine(ckpt, block_size=4, num_kv_blocks=64)
    ref = reference[3]
    stop_tok = ref[5]
    k = ref.index(stop_tok)
    out = eng.generate([prompts()[3]], SamplingParams(max_tokens=14, stop_token_ids=[stop_tok], **GREEDY))[0]
    assert out.finish_reason == "stop" and out.output_token_ids == ref[:k + 1]
    out = eng.generate([prompts()[3]], SamplingParams(max_tokens=3, **GREEDY))[0]
    assert out.finish_reason == "length" and out.output_token_ids == ref[:3]


def test_bad_requests_raise_value_error(ckpt):
    eng = engine(ckpt, block_size=4, num_kv_blocks=16)  # 64-token context
    assert eng.max_model_len == 64
    with pytest.raises(ValueError, match="context"):
        eng.add_request("long", list(range(10, 80)), SamplingParams())
    eng.add_request("x", [5, 6, 7], SamplingParams())
    with pytest.raises(ValueError, match="duplicate"):
        eng.add_request("x", [5, 6, 7], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("y", [], SamplingParams())
    with pytest.raises(ValueError):
        eng.add_request("z", [10 ** 9], SamplingParams())
