"""Logprobs are extracted batched (one gather / one topk per distinct n, no per-row .item()), and with async
scheduling in "stream" mode greedy rows with logprobs stay on the device path. References: float64 log_softmax
of the logits per row, and the synchronous engine's outputs (token ids, logprobs, text)."""
import pytest
import torch

from kestrel.engine import EngineConfig, LLMEngine, SamplingParams
from kestrel.engine.async_step import AsyncStepper
from kestrel.engine.sampler import Sampler
from test_model_hf_tiny import make_tiny_checkpoint


def test_batched_logprobs_match_float64_reference():
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    ps = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0),
          SamplingParams(temperature=0.7, logprobs=0, seed=2), SamplingParams(temperature=0, logprobs=0),
          SamplingParams(temperature=1.0, logprobs=5, seed=3), SamplingParams(temperature=0, logprobs=3)]
    toks, lps = Sampler(0)(logits.clone(), ps, None, [None] * len(ps))
    ref = logits.double().log_softmax(-1)
    for r, p in enumerate(ps):
        if p.logprobs is None:
            assert lps[r] is None
            continue
        assert lps[r]["token_id"] == toks[r]
        assert abs(lps[r]["logprob"] - ref[r, toks[r]].item()) < 1e-5
        top = lps[r]["top"]
        assert len(top) == p.logprobs
        vals, idx = ref[r].topk(p.logprobs) if p.logprobs else (torch.zeros(0), torch.zeros(0, dtype=torch.long))
        assert list(top) == idx.tolist()  # same ids, same (descending) order
        assert all(abs(top[k] - v) < 1e-5 for k, v in zip(idx.tolist(), vals.tolist()))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_llama_lp"))
    make_tiny_checkpoint(path, "llama-tied-linear-rope", seed=3)
    return path


@pytest.mark.parametrize("mode", ["stream", "thread"])
def test_async_greedy_logprobs_equal_sync(ckpt, mode):
    prompts = [[1, 504, 3108, 314] + [100 + 7 * i + j for j in range(3 + 2 * i)] for i in range(3)]
    params = [SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, logprobs=n) for n in (0, 2, None)]
    res = []
    for on in (False, True):
        eng = LLMEngine(EngineConfig(model=ckpt, progress=False, async_scheduling=on, block_size=4, num_kv_blocks=64))
        if on:
            eng.async_stepper = AsyncStepper(eng, mode)
        for i, (pr, p) in enumerate(zip(prompts, params)):
            eng.add_request(f"r{i}", pr, p)
        got = {f"r{i}": [] for i in range(3)}
        while eng.has_unfinished():
            for o in eng.step():
                got[o.request_id].append((o.new_token_ids, o.logprobs, o.new_text, o.finish_reason))
        eng.drain()
        res.append(got)
    sync, asyn = res
    assert sync.keys() == asyn.keys()
    for rid in sync:
        assert [(t, x, r) for t, _, x, r in sync[rid]] == [(t, x, r) for t, _, x, r in asyn[rid]]
        for (_, a, _, _), (_, b, _, _) in zip(sync[rid], asyn[rid]):
            if a is None:
                assert b is None
                continue
            assert a[0]["token_id"] == b[0]["token_id"] and list(a[0]["top"]) == list(b[0]["top"])
            assert abs(a[0]["logprob"] - b[0]["logprob"]) < 1e-5
    assert all(o[1] is not None for o in sync["r0"]) and all(o[1] is None for o in sync["r2"])


def test_batched_logprobs_all_rows_no_index_copy_path():
    torch.manual_seed(1)
    logits = torch.randn(4, 30) * 2
    ps = [SamplingParams(temperature=0, logprobs=2) for _ in range(4)]
    toks, lps = Sampler(0)(logits.clone(), ps, None, [None] * 4)
    ref = logits.double().log_softmax(-1)
    for r in range(4):
        assert toks[r] == int(logits[r].argmax())
        assert abs(lps[r]["logprob"] - ref[r, toks[r]].item()) < 1e-5
        assert list(lps[r]["top"]) == ref[r].topk(2).indices.tolist()
