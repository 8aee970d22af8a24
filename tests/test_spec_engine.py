"""Speculative decoding inside the engine: greedy output token-identical to plain decoding (n-gram, draft model,
trained draft head), KV of rejected drafts rolled back (no leaked blocks, also under preemption), streaming
deltas add up, sampling respects limits, stats exported; `kestrel train-draft` runs end to end on a tiny target."""
import os

import pytest
import torch

import kestrel.spec  # noqa: F401  (registers the speculative step with the engine)
from kestrel.engine.llm_engine import LLMEngine
from kestrel.engine.sampling_params import SamplingParams
from kestrel.spec.config import SpeculativeConfig
from kestrel.spec.decoder import SpecDecoder
from kestrel.spec.draft_model import DraftModelDrafter
from kestrel.spec.factory import _model_logits_fn

# tiny random Llama (vocab 256: digit prompts of the SmolLM2 tokenizer stay inside it)
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
PROMPTS = ["1 2 3 4 5 1 2 3 4 5 1 2", "9 8 7 6", "0 0 1 1 2 2 0 0 1 1", "3 1 4 1 5 9 2 6", "1 2 3 4 5 1 2 3 4"]


def _engine(spec=None, **kw):
    args = dict(load_format="dummy", model_shape=SHAPE, num_kv_blocks=96, block_size=4, progress=False,
                max_num_seqs=8, speculative=spec)
    args.update(kw)
    return LLMEngine(**args)


def _run(engine, prompts, params):
    """Stream everything; returns per-request (concatenated new_token_ids, final output, concatenated text, final)."""
    ids = [f"r{i}" for i in range(len(prompts))]
    ps = params if isinstance(params, list) else [params] * len(prompts)
    for rid, p, sp in zip(ids, prompts, ps):
        engine.add_request(rid, p, sp)
    streamed = {r: [] for r in ids}
    text = {r: "" for r in ids}
    final = {}
    engine.test_num_outputs = 0  # RequestOutputs = (request, forward) pairs that produced tokens
    while engine.has_unfinished():
        for o in engine.step():
            engine.test_num_outputs += 1
            streamed[o.request_id] += o.new_token_ids
            text[o.request_id] += o.new_text
            if o.finished:
                final[o.request_id] = o
    return streamed, final, text


@pytest.fixture(scope="module")
def reference():
    e = _engine()
    streamed, final, _ = _run(e, PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    return {r: o.output_token_ids for r, o in final.items()}, e.test_num_outputs


@pytest.mark.parametrize("spec", ["drafter=ngram,k=4", "drafter=ngram,k=1,schedule=fixed",
                                  "drafter=ngram,k=4,schedule=fixed"])
def test_greedy_ngram_identical_to_plain(reference, spec):
    ref, ref_steps = reference
    e = _engine(spec)
    streamed, final, text = _run(e, PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert {r: o.output_token_ids for r, o in final.items()} == ref
    assert streamed == ref  # streaming deltas (several tokens per step) add up to the output
    assert all(text[r] == final[r].text for r in final)
    s = e.stats()
    assert s["spec_num_draft_tokens"] > 0 and s["spec_num_accepted_tokens"] > 0
    assert 0 < s["spec_acceptance_rate"] <= 1 and s["spec_mean_accepted_length"] >= 1
    assert e.test_num_outputs < ref_steps  # accepted drafts: fewer forwards per request
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"]  # rejected-draft KV blocks were released


def test_greedy_identical_under_preemption_and_prefix_cache(reference):
    """A KV cache too small for all requests forces preemption/recompute; shared prefixes hit the prefix cache."""
    ref, _ = reference
    e = _engine("drafter=ngram,k=4", num_kv_blocks=24)
    _, final, _ = _run(e, PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert {r: o.output_token_ids for r, o in final.items()} == ref
    s = e.stats()
    assert s["num_preemptions"] > 0 and s["num_free_kv_blocks"] == s["num_kv_blocks"]


def test_draft_model_self_draft(reference):
    """The target as its own draft model: greedy drafts are (almost) always accepted, output unchanged."""
    ref, _ = reference
    e = _engine()
    e.spec = SpecDecoder(SpeculativeConfig(k=3, schedule="fixed"), DraftModelDrafter(_model_logits_fn(e.model, "cpu")))
    _, final, _ = _run(e, PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert {r: o.output_token_ids for r, o in final.items()} == ref
    assert e.stats()["spec_acceptance_rate"] > 0.9


def test_sampling_limits_penalties_and_logprobs():
    e = _engine("drafter=ngram,k=4")
    params = [SamplingParams(max_tokens=17, temperature=0.8, seed=1),
              SamplingParams(max_tokens=9, temperature=1.0, top_k=5),
              SamplingParams(max_tokens=12, temperature=0.7, presence_penalty=0.5),  # never speculates
              SamplingParams(max_tokens=10, temperature=0, logprobs=2),
              SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9)]
    for p in params:
        p.ignore_eos = True
    streamed, final, _ = _run(e, PROMPTS, params)
    for i, p in enumerate(params):
        out = final[f"r{i}"]
        assert len(out.output_token_ids) == p.max_tokens and streamed[f"r{i}"] == out.output_token_ids
        assert all(0 <= t < SHAPE["vocab_size"] for t in out.output_token_ids)
    assert e.stats()["num_free_kv_blocks"] == e.stats()["num_kv_blocks"]


def test_logprobs_match_plain(reference):
    plain, spec = _engine(), _engine("drafter=ngram,k=4")
    p = SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)
    a = plain.generate(PROMPTS[:2], p)
    streamed_lp = {}
    for rid, pr in zip(["a", "b"], PROMPTS[:2]):
        spec.add_request(rid, pr, p)
    while spec.has_unfinished():
        for o in spec.step():
            streamed_lp.setdefault(o.request_id, []).extend(o.logprobs or [])
    for rid, ref in zip(["a", "b"], a):
        got = streamed_lp[rid]
        assert [g["token_id"] for g in got] == ref.output_token_ids
        assert len(got) == len(ref.output_token_ids)
        assert all(set(g["top"]) and len(g["top"]) == 2 for g in got)


def test_bad_speculative_config():
    with pytest.raises(ValueError):
        _engine("drafter=nope")
    with pytest.raises(ValueError):
        _engine("drafter=head")  # needs head=FILE


def test_train_draft_cli_and_head_drafter(tmp_path, reference):
    """Tiny self-distillation run through the CLI; the trained head then drafts losslessly and is accepted far
    more often than an untrained head of the same shape."""
    from kestrel.cli import main
    from kestrel.spec.draft_head import DraftHead

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "head.safetensors"
    import json
    rc = main(["train-draft", "--load-format", "dummy", "--model-shape", json.dumps(SHAPE), "--prompts", str(prompts),
               "--no-chat", "--num-prompts", "10", "--gen-tokens", "40", "--gen-temperature", "0", "--k", "3",
               "--steps", "200", "--batch-positions", "128", "--lr", "3e-3", "--out", str(out), "--no-progress"])
    assert rc == 0 and out.exists()
    head = DraftHead.load(str(out))
    assert head.k == 3
    untrained = tmp_path / "untrained.safetensors"
    torch.manual_seed(0)
    DraftHead(SHAPE["hidden_size"], k=3).save(str(untrained))

    ref, _ = reference
    rates = {}
    for name, f in [("trained", out), ("untrained", untrained)]:
        e = _engine(f"drafter=head,head={f},k=3,schedule=fixed")
        _, final, _ = _run(e, PROMPTS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        assert {r: o.output_token_ids for r, o in final.items()} == ref
        rates[name] = e.stats()["spec_acceptance_rate"]
    assert rates["trained"] > rates["untrained"] + 0.2
    e = _engine(f"drafter=head,head={out},k=3")  # sampled rows: the head samples from q and verifies against it
    sp = [SamplingParams(max_tokens=15, temperature=0.9, ignore_eos=True, seed=i) for i in range(len(PROMPTS))]
    streamed, final, _ = _run(e, PROMPTS, sp)
    assert all(len(o.output_token_ids) == 15 for o in final.values()) and e.stats()["spec_num_draft_tokens"] > 0
    with pytest.raises(ValueError):
        DraftHead.load(str(prompts))  # not a safetensors head: clear error
    assert main(["train-draft", "--steps", "0", "--out", str(out)]) == 2  # bad flag value -> message, exit 2


def test_train_draft_init_continues_from_a_head(tmp_path):
    """--init starts from a saved head (weights carried, not re-initialised); a head of another k is refused."""
    import json

    from kestrel.cli import main
    from kestrel.spec.draft_head import DraftHead

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    torch.manual_seed(1)
    init = DraftHead(SHAPE["hidden_size"], k=3)
    with torch.no_grad():
        init.slot.fill_(0.5)  # far from a fresh head's randn * 0.02
    init.save(str(tmp_path / "init.safetensors"))
    out = tmp_path / "cont.safetensors"
    base = ["train-draft", "--load-format", "dummy", "--model-shape", json.dumps(SHAPE), "--prompts", str(prompts),
            "--no-chat", "--num-prompts", "4", "--gen-tokens", "8", "--steps", "2", "--batch-positions", "16",
            "--lr", "1e-6", "--out", str(out), "--no-progress", "--init", str(tmp_path / "init.safetensors")]
    assert main(base + ["--k", "3"]) == 0
    got = DraftHead.load(str(out))
    assert torch.allclose(got.slot, init.slot, atol=1e-3)
    assert main(base + ["--k", "4"]) == 2  # k differs from the head's: a message, exit 2
