"""The hidden states the draft head is trained on are the ones the live decode hands it: same layer (final), same
norm (post-norm), same dtype, same position (h_t with x_{t+1} the last token) - in the synchronous speculative step
and in the overlapped device loop. The reference is a plain full forward over the finished text (collect_hidden);
train-draft's lockstep generator (static_generate) must give the same states and the same greedy tokens as the
engine."""
import pytest
import torch

import kestrel.spec  # noqa: F401
from kestrel.engine.sampling_params import SamplingParams
from kestrel.spec.draft_head import DraftHead
from kestrel.spec.head_drafter import HeadDrafter
from kestrel.spec.spec_loop import SpecLoop
from kestrel.spec.static_generate import generate
from kestrel.spec.train_draft import collect_hidden
from test_spec_engine import PROMPTS, SHAPE, _engine, _run

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _prompt_ids(e):
    return [e.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]  # as add_request encodes


@pytest.fixture(scope="module")
def head_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("head") / "head.safetensors"
    torch.manual_seed(0)
    DraftHead(SHAPE["hidden_size"], k=3, recurrent=True).save(str(f))
    return str(f)


def _check(records, final, prompts, model):
    """records: (request id, tokens known so far, hidden handed to the drafter); compare with the full forward."""
    seqs = {r: p + final[r].output_token_ids for r, p in zip(sorted(final), prompts)}
    ref = dict(zip(seqs, collect_hidden(model, list(seqs.values()), "cpu", progress=False)))
    n = 0
    for rid, L, h in records:
        if not h.any():  # a row that entered the loop without a state yet (starts from zeros by design)
            continue
        assert h.dtype == model.embed_tokens.weight.dtype
        torch.testing.assert_close(h, ref[rid][L - 2], atol=1e-4, rtol=1e-4)  # h_{L-2} produced token L-1
        n += 1
    return n


def test_sync_step_feeds_training_hidden_states(head_file, monkeypatch):
    records = []
    propose = HeadDrafter.propose

    def spy(self, inputs, k):
        records.extend((i.request_id, len(i.token_ids), i.hidden.clone()) for i in inputs if i.hidden is not None)
        return propose(self, inputs, k)
    monkeypatch.setattr(HeadDrafter, "propose", spy)
    e = _engine(f"drafter=head,head={head_file},k=3,schedule=fixed,loop=off")
    _, final, _ = _run(e, PROMPTS, GREEDY)
    assert _check(records, final, _prompt_ids(e), e.model) > 20


def test_device_loop_feeds_training_hidden_states(head_file, monkeypatch):
    records = []
    step = SpecLoop._step

    def spy(self, bs, K):
        if K and not self.use_graphs:  # eager (CPU) steps only: a captured step runs once, at capture
            for r, s in enumerate(self.rows):
                if self.live[r] and self.active[r]:
                    records.append((s.request_id, int(self.length[r]), self.hidden[r].clone()))
        return step(self, bs, K)
    monkeypatch.setattr(SpecLoop, "_step", spy)
    e = _engine(f"drafter=head,head={head_file},k=3,schedule=fixed,loop=on")
    _, final, _ = _run(e, PROMPTS, GREEDY)
    assert _check(records, final, _prompt_ids(e), e.model) > 20


@pytest.mark.parametrize("paged", [False, True])  # dense SDPA (the CPU path) and the paged Triton kernels (CUDA's)
def test_static_generate_matches_engine_tokens_and_states(paged):
    e = _engine()
    prompts = _prompt_ids(e)
    _, final, _ = _run(e, PROMPTS, GREEDY)
    ref_out = [final[r].output_token_ids for r in sorted(final)]
    outs, hid = generate(e.model, prompts, 24, batch_size=3, paged=paged)  # batches of mixed prompt lengths
    assert outs == ref_out
    full = collect_hidden(e.model, [p + o for p, o in zip(prompts, outs)], "cpu", progress=False)
    for p, o, h, f in zip(prompts, outs, hid, full):
        assert h.shape == (len(o), SHAPE["hidden_size"]) and h.dtype == f.dtype
        torch.testing.assert_close(h, f[len(p) - 1:len(p) - 1 + len(o)], atol=1e-4, rtol=1e-4)
