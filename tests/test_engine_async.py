"""Async scheduling (step n+1 prepared while step n runs, tokens committed one step late) gives exactly the
outputs of the synchronous engine on a tiny random Llama: token ids, streamed text, finish reasons; with requests
joining mid-run, stop strings / stop token ids / max_tokens / context-length stops, aborts mid-run, chunked prefill,
preemption under a tiny KV cache, penalties and seeded sampling. Every KV block is free at the end."""
import argparse
import asyncio

import pytest

from kestrel.engine import EngineConfig, LLMEngine, SamplingParams
from kestrel.engine.async_step import AsyncStepper
from test_model_hf_tiny import make_tiny_checkpoint

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_llama_async"))
    make_tiny_checkpoint(path, "llama-tied-linear-rope", seed=1)
    return path


def engine(path, async_scheduling, mode=None, **kw):
    eng = LLMEngine(EngineConfig(model=path, progress=False, async_scheduling=async_scheduling, **kw))
    assert (eng.async_stepper is not None) == async_scheduling
    if mode is not None:  # "stream" is the CUDA default; on the CPU it runs the same device-gather logic inline
        eng.async_stepper = AsyncStepper(eng, mode)
    return eng


def prompt(i, n):
    return [1, 504, 3108, 314] + [100 + 7 * i + j for j in range(n)]


def run(eng, script, n_blocks, drain_every=0):
    """script: list of (request_id, prompt, params, trigger, abort_after). A request is added when `trigger`
    (request_id, k) is met: that request has streamed k tokens (None = at the start); it is aborted once it has
    streamed abort_after tokens. Triggers count committed tokens, so both modes act at the same logical point."""
    streamed = {r[0]: [] for r in script}
    text = {r[0]: "" for r in script}
    reason = {}
    pending = list(script)

    def fire():
        for item in list(pending):
            rid, p, params, trig, _ = item
            if trig is None or len(streamed[trig[0]]) >= trig[1] or trig[0] in reason:
                eng.add_request(rid, p, params)
                pending.remove(item)
        for rid, _, _, _, abort_after in script:
            if abort_after is not None and rid not in reason and len(streamed[rid]) >= abort_after:
                assert eng.abort_request(rid)
                reason[rid] = "abort"

    fire()
    steps = 0
    while eng.has_unfinished() or pending:
        # drain(): what the server does before touching KV blocks from outside the loop
        outs = eng.step() + (eng.drain() if drain_every and steps % drain_every == 0 else [])
        for out in outs:
            assert out.request_id not in reason, "output after finish/abort"
            streamed[out.request_id] += out.new_token_ids
            assert out.output_token_ids == streamed[out.request_id]
            text[out.request_id] += out.new_text
            if out.finished:
                reason[out.request_id] = out.finish_reason
                assert out.text == text[out.request_id]
        fire()
        steps += 1
        assert steps < 3000
    st = eng.stats()
    assert st["num_free_kv_blocks"] == n_blocks and st["num_running"] == 0 and st["num_waiting"] == 0
    return streamed, text, reason, st


@pytest.fixture(scope="module")
def stop_material(ckpt):
    """A stop string and a stop token taken from a plain greedy run, so they do occur."""
    eng = engine(ckpt, False, block_size=4, num_kv_blocks=64)
    out = eng.generate([prompt(2, 9)], SamplingParams(max_tokens=16, **GREEDY))[0]
    t = out.text
    assert len(t) > 8
    return t[len(t) // 2: len(t) // 2 + 2], out.output_token_ids[6]


def workload(stop_str, stop_tok):
    g = lambda **kw: SamplingParams(**{**GREEDY, **kw})
    return [
        ("a", prompt(0, 14), g(max_tokens=12), None, None),
        ("b", prompt(1, 3), g(max_tokens=1), None, None),  # finishes at its first token
        ("c", prompt(2, 9), g(max_tokens=16, stop=[stop_str]), ("a", 2), None),
        ("d", prompt(2, 9), g(max_tokens=16, stop_token_ids=[stop_tok]), ("a", 3), None),
        ("e", prompt(3, 20), g(max_tokens=30), ("a", 1), 4),  # aborted mid-run
        ("f", prompt(4, 5), g(max_tokens=9, presence_penalty=0.8, frequency_penalty=0.5), ("c", 2), None),
        ("g", prompt(5, 6), SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7), ("a", 4), None),
        ("h", prompt(6, 11), g(max_tokens=10), ("b", 1), None),
    ]


@pytest.mark.parametrize("kv", [dict(num_kv_blocks=128, max_num_batched_tokens=512),
                                dict(num_kv_blocks=18, max_num_batched_tokens=10, max_num_seqs=5)],
                         ids=["roomy", "tiny-kv-chunked"])
@pytest.mark.parametrize("mode", ["thread", "stream"])
def test_async_equals_sync(ckpt, stop_material, kv, mode):
    results = []
    for on in (False, True):
        eng = engine(ckpt, on, mode=mode if on else None, block_size=4, **kv)
        drain = 5 if on and kv["num_kv_blocks"] == 18 else 0
        results.append(run(eng, workload(*stop_material), kv["num_kv_blocks"], drain_every=drain))
    (s_tok, s_txt, s_why, s_st), (a_tok, a_txt, a_why, a_st) = results
    assert a_tok == s_tok and a_txt == s_txt and a_why == s_why
    assert s_why["c"] == "stop" and s_why["d"] == "stop" and s_why["e"] == "abort" and s_why["a"] == "length"
    assert len(s_tok["e"]) == 4
    assert a_st["num_generated_tokens"] == s_st["num_generated_tokens"]
    if kv["num_kv_blocks"] == 18:
        assert s_st["num_preemptions"] > 0 and a_st["num_preemptions"] > 0


def test_async_context_length_stop(ckpt):
    # 12-token context: requests stop on the context, not on max_tokens; no step may ask for a slot past it
    outs, steps = [], []
    for mode in (False, True):
        eng = engine(ckpt, mode, block_size=4, num_kv_blocks=3)
        outs.append(eng.generate([prompt(0, 3), prompt(1, 5)], SamplingParams(max_tokens=50, **GREEDY)))
        assert eng.stats()["num_free_kv_blocks"] == 3
        steps.append(eng.stats()["num_steps"])
    assert steps[0] == steps[1]  # a request sure to stop on length is not scheduled for a wasted extra step
    assert [o.output_token_ids for o in outs[0]] == [o.output_token_ids for o in outs[1]]
    assert [len(o.output_token_ids) for o in outs[1]] == [5, 3]
    assert all(o.finish_reason == "length" for o in outs[1])


def test_async_flag_and_errors(ckpt):
    from kestrel.commands.engine_args import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args(["--async-scheduling"]).async_scheduling is True
    assert p.parse_args(["--no-async-scheduling"]).async_scheduling is False
    assert p.parse_args([]).async_scheduling is None  # auto: on unless unsupported features are on
    assert LLMEngine(EngineConfig(model=ckpt, progress=False)).async_stepper is not None
    import kestrel.spec  # noqa: F401  (registers the speculative step)

    spec = LLMEngine(EngineConfig(model=ckpt, progress=False, speculative="drafter=ngram,k=2"))
    assert spec.async_stepper is None
    with pytest.raises(ValueError, match="async-scheduling"):
        LLMEngine(EngineConfig(model=ckpt, progress=False, async_scheduling=True, speculative="drafter=ngram,k=2"))


def test_async_server_loop_streams_and_drains_for_calls(ckpt):
    """AsyncLLMEngine over an async-scheduled engine: concurrent streams equal offline sync generation, and a
    call() between steps (as KV export/import does) finds nothing in flight."""
    from kestrel.engine.async_engine import AsyncLLMEngine

    params = SamplingParams(max_tokens=8, **GREEDY)
    ps = [prompt(i, 4 + 3 * i) for i in range(3)]
    ref = [o.output_token_ids for o in engine(ckpt, False, block_size=4, num_kv_blocks=64).generate(ps, params)]
    aeng = AsyncLLMEngine(engine(ckpt, True, block_size=4, num_kv_blocks=64))

    idle = []

    async def one(i):
        outs = []
        async for o in aeng.generate(f"r{i}", ps[i], params):
            outs.append(o)
            if i == 0 and len(outs) == 2:  # mid-run, while the others are still decoding
                idle.append(await aeng.call(lambda eng: eng.async_stepper.inflight is None))
        return outs

    async def main():
        return await asyncio.gather(*(one(i) for i in range(3)))

    try:
        streams = asyncio.run(main())
    finally:
        aeng.shutdown()
    assert idle == [True]
    assert [s[-1].output_token_ids for s in streams] == ref
    assert [sum((o.new_token_ids for o in s), []) for s in streams] == ref


def test_stream_mode_launches_before_reading_previous_tokens(ckpt, monkeypatch):
    """"stream" mode (CUDA's default): step n+1 is launched while step n's sampled ids are still unread on the
    host (its decode inputs are gathered from step n's id tensor), and tokens equal the synchronous engine's."""
    import kestrel.engine.async_step as a

    log = []
    real_result = a._DeviceTokens.result
    monkeypatch.setattr(a._DeviceTokens, "result", lambda self: (log.append("read"), real_result(self))[1])
    ps = [prompt(i, 3 + 2 * i) for i in range(3)]
    params = SamplingParams(max_tokens=6, **GREEDY)
    ref = [o.output_token_ids for o in engine(ckpt, False, block_size=4, num_kv_blocks=64).generate(ps, params)]
    eng = engine(ckpt, True, mode="stream", block_size=4, num_kv_blocks=64)
    real_execute = eng.runner.execute
    eng.runner.execute = lambda st: (log.append("launch"), real_execute(st))[1]
    assert [o.output_token_ids for o in eng.generate(ps, params)] == ref
    launches = [i for i, x in enumerate(log) if x == "launch"]
    assert len(launches) >= 6
    for k, i in enumerate(launches[1:], start=1):  # before launch k: only the steps before k-1 were read
        assert log[:i].count("read") == k - 1
