"""AsyncLLMEngine on the real engine (embedded SmolLM2): streams equal offline generation, cancelling frees KV
blocks, rejected prompts and engine failures reach the caller as exceptions (never a hang), idle means asleep."""
from __future__ import annotations

import asyncio
import time

import pytest

from kestrel.engine.async_engine import AsyncLLMEngine, EngineError
from kestrel.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture
def aengine(smollm2_engine):
    a = AsyncLLMEngine(smollm2_engine)
    yield a
    a.shutdown()
    assert not a.is_alive


def wait_for(pred, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout  # a hang guard, not a performance threshold
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


async def collect(aengine, rid, prompt, params):
    return [out async for out in aengine.generate(rid, prompt, params)]


def test_concurrent_streams_equal_offline_generation(aengine, smollm2_engine):
    prompts = ["The moon is", "Python is a", "Bread is made from"]

    async def main():
        return await asyncio.gather(*(collect(aengine, f"r{i}", p, GREEDY) for i, p in enumerate(prompts)))

    streams = asyncio.run(main())
    aengine.shutdown()  # hand the engine back for the offline reference
    ref = smollm2_engine.generate(prompts, GREEDY)
    for outs, r in zip(streams, ref):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert [t for o in outs for t in o.new_token_ids] == r.output_token_ids
        assert "".join(o.new_text for o in outs) == r.text


def test_closing_the_stream_aborts_and_frees_blocks(aengine):
    free_before = aengine.stats()["num_free_kv_blocks"]

    async def main():
        gen = aengine.generate("long", "Tell me a long story.", SamplingParams(max_tokens=400, ignore_eos=True))
        got = [await gen.__anext__() for _ in range(3)]
        held = aengine.stats()
        await gen.aclose()
        return got, held

    got, held = asyncio.run(main())
    assert len(got) == 3 and not got[-1].finished and held["num_free_kv_blocks"] < free_before
    wait_for(lambda: aengine.stats()["num_running"] == 0 and aengine.num_active == 0, "the abort")
    assert aengine.stats()["num_free_kv_blocks"] == free_before


def test_cancelled_task_aborts(aengine):
    async def main():
        task = asyncio.ensure_future(collect(aengine, "c", "Count to one hundred:", SamplingParams(max_tokens=400)))
        while aengine.stats()["num_running"] == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    wait_for(lambda: aengine.stats()["num_running"] == 0 and aengine.num_active == 0, "the abort")


def test_rejected_prompt_raises_value_error(aengine, smollm2_engine):
    too_long = [1] * smollm2_engine.max_model_len
    with pytest.raises(ValueError, match="tokens"):
        asyncio.run(collect(aengine, "big", too_long, GREEDY))
    assert aengine.num_active == 0


def test_engine_failure_fails_the_request_then_recovers(aengine, smollm2_engine, monkeypatch):
    real_step = smollm2_engine.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 2:  # mid-generation
            raise RuntimeError("injected failure")
        return real_step()

    monkeypatch.setattr(smollm2_engine, "step", failing_step)
    with pytest.raises(EngineError, match="injected failure"):
        asyncio.run(collect(aengine, "f", "Hello there", SamplingParams(max_tokens=20, ignore_eos=True)))
    wait_for(lambda: aengine.stats()["num_running"] == 0, "the failed request to be dropped")
    outs = asyncio.run(collect(aengine, "g", "Hello there", GREEDY))  # the engine still serves
    assert outs[-1].finished and len(outs[-1].output_token_ids) >= 1


def test_idle_engine_thread_sleeps(aengine, smollm2_engine, monkeypatch):
    calls = {"n": 0}
    real = smollm2_engine.has_unfinished

    def counting():
        calls["n"] += 1
        return real()

    monkeypatch.setattr(smollm2_engine, "has_unfinished", counting)
    asyncio.run(collect(aengine, "w", "Hi", GREEDY))  # wakes it, then it goes idle
    wait_for(lambda: aengine.num_active == 0, "idle")
    time.sleep(0.2)
    n = calls["n"]
    time.sleep(0.5)
    assert calls["n"] == n  # no polling while there is nothing to do
