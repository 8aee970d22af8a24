"""Pieces of the draft head's self-distillation: packed hidden-state collection, the recurrent refiner, bf16 save."""
import pytest
import torch

from kestrel.spec.draft_head import DraftHead
from kestrel.spec.prompt_set import varied_prompts
from kestrel.spec.train_draft import collect_hidden


def _tiny_model():
    from kestrel.engine.config import EngineConfig
    from kestrel.engine.llm_engine import LLMEngine
    shape = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256)
    eng = LLMEngine(EngineConfig(load_format="dummy", model_shape=shape, num_kv_blocks=16, block_size=4,
                                 progress=False, dtype="float32"))
    return eng.model


def test_packed_hidden_equals_one_forward_per_sequence():
    """Sequences packed into one forward (block-diagonal causal mask) give each sequence's own hidden states."""
    model = _tiny_model()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(128, (n,), generator=g).tolist() for n in (5, 17, 3, 11, 9)]
    ref = collect_hidden(model, seqs, "cpu", progress=False)
    packed = collect_hidden(model, seqs, "cpu", progress=False, max_tokens=30)
    assert [h.shape for h in packed] == [h.shape for h in ref]
    for a, b in zip(packed, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_recurrent_head_drafts_match_teacher_forcing_on_its_own_drafts():
    """The greedy draft loop and the teacher-forced chain are the same function: fed the head's own drafts as the
    'true' previous tokens, forward_teacher reproduces draft()'s logits argmax; the recurrent refiner reads the
    whole chain (changing the slot-1 token changes slot 3's state, which the non-recurrent head cannot)."""
    torch.manual_seed(0)
    H, V, k = 16, 50, 4
    embed, lm_head = torch.randn(V, H), torch.randn(V, H)
    head = DraftHead(H, k=k, recurrent=True).eval()
    h, x = torch.randn(3, H), torch.tensor([1, 7, 9])
    toks, conf, _ = head.draft(h, x, embed, lm_head, k)
    prev = torch.cat([x[:, None], toks[:, :-1]], 1)
    logits, c = head.forward_teacher(h, embed[x], embed[prev], lm_head)
    assert torch.equal(logits.argmax(-1), toks)
    torch.testing.assert_close(torch.sigmoid(c), conf)
    g_toks, g_conf = head.draft_greedy(h, x, embed, lm_head, k)
    assert torch.equal(g_toks, toks)
    z = head.slots(h, embed[x])
    alt = prev.clone()
    alt[:, 1] = (alt[:, 1] + 1) % V  # a different slot-1 draft
    a, b = head.chain(z, embed[prev]), head.chain(z, embed[alt])
    assert not torch.allclose(a[:, 3], b[:, 3])


def test_bf16_save_roundtrip(tmp_path):
    head = DraftHead(16, k=2, recurrent=True)
    p = tmp_path / "h.safetensors"
    head.save(str(p), dtype=torch.bfloat16)
    back = DraftHead.load(str(p))
    assert back.recurrent and back.k == 2
    for (n, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        torch.testing.assert_close(b, a.to(torch.bfloat16).float(), msg=n)


def test_varied_prompt_set_is_large_and_distinct():
    p = varied_prompts()
    assert len(p) > 5000 and len(set(p)) == len(p)
    assert varied_prompts(10) == p[:10]


def test_training_positions_skip_prompts_and_partial_hidden_gathers_the_same():
    """Positions are drawn only past each prompt (where the head drafts at inference), inputs are (h_t, x_{t+1}),
    and hidden states that cover only the generated part (static_generate) give the same batches as full ones."""
    from kestrel.spec.train_draft import _Packed, _sample_batch
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(100, (n,), generator=g).tolist() for n in (12, 30, 7)]
    plens = [5, 20, 3]
    # hidden state of (sequence j, position t) = [j, t, noise...]: the batch says where it was taken
    full = [torch.cat([torch.tensor([[j, t] for t in range(len(s))], dtype=torch.float32),
                       torch.randn(len(s), 6, generator=g)], 1) for j, s in enumerate(seqs)]
    part = [h[p - 1:] for h, p in zip(full, plens)]
    a = _Packed(full, seqs, "cpu", plens)
    b = _Packed(part, seqs, "cpu", plens, [p - 1 for p in plens])
    assert len(a.pos) == sum(len(s) - p - 1 for s, p in zip(seqs, plens))
    for x, y in zip(_sample_batch(a, 3, 256, torch.Generator().manual_seed(1), "cpu"),
                    _sample_batch(b, 3, 256, torch.Generator().manual_seed(1), "cpu")):
        assert torch.equal(x, y)
    h, nxt, prev, teach, label, mask = _sample_batch(a, 3, 256, torch.Generator().manual_seed(1), "cpu")
    for row in range(256):
        j, t = int(h[row, 0]), int(h[row, 1])
        assert plens[j] - 1 <= t <= len(seqs[j]) - 3
        assert nxt[row] == seqs[j][t + 1] and label[row, 0] == seqs[j][t + 2]
        assert int(teach[row, 0, 1]) == t + 1  # slot 0's teacher is the state that predicts x_{t+2}


def test_self_written_prompts_and_heldout_split_are_disjoint():
    """'varied+self' fills --num-prompts with prompts the target writes itself (distinct), and the held-out
    sequences (front of the list, greedy) share no prompt with the training ones."""
    import argparse

    from kestrel.engine.llm_engine import LLMEngine
    from kestrel.spec import train_cli
    shape = dict(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512)
    eng = LLMEngine(load_format="dummy", model_shape=shape, progress=False, dtype="float32")
    p = argparse.ArgumentParser()
    train_cli.add_parser(p.add_subparsers())
    args = p.parse_args(["train-draft", "--prompts", "self", "--num-prompts", "12", "--heldout", "0.25",
                         "--gen-tokens", "6", "--self-prompt-tokens", "6", "--gen-batch", "8", "--gen-temperature", "0.8"])
    texts = train_cli._prompt_texts(eng, args)
    assert len(texts) == 12 and len(set(texts)) == 12
    seqs, plens, n_ho, hidden, offs = train_cli._generate(eng, args)
    assert n_ho == 3 and len(seqs) == 12
    held = {tuple(s[:p]) for s, p in zip(seqs[:n_ho], plens[:n_ho])}
    assert not held & {tuple(s[:p]) for s, p in zip(seqs[n_ho:], plens[n_ho:])}
    for s, p, h, o in zip(seqs, plens, hidden, offs):
        assert o == p - 1 and len(h) == len(s) - p  # one state per generated token


def test_head_norm_keeps_the_training_eps_in_bf16():
    """The head's norm (_rms: the Triton row kernel on CUDA at inference) normalises a bf16 head's small-norm states
    as its float32 training did (an eps of bf16's 0.0078 would shrink them ~3x here)."""
    from kestrel.spec.draft_head import _rms
    norm = torch.nn.RMSNorm(64)
    x = torch.randn(8, 64) * 0.03  # mean square ~1e-3, well below bf16's eps
    ref = norm(x)  # float32 training path
    got = _rms(norm.to(torch.bfloat16), x.to(torch.bfloat16)).float()
    assert torch.allclose(got, ref, rtol=2e-2, atol=2e-2)


def test_draft_vocab_readout_matches_a_full_readout_restricted_to_it(tmp_path):
    """Greedy drafting over the head's draft vocabulary (norm folded into the readout) proposes, slot by slot, the
    argmax of the full-vocabulary logits restricted to that vocabulary: with all tokens in it, exactly the full
    drafts; with a subset, only its tokens, each the best of them given the chain. The vocabulary survives
    save/load, and train-draft's frequent_tokens picks by count."""
    from kestrel.spec.train_cli import frequent_tokens
    torch.manual_seed(0)
    H, V, k = 16, 50, 4
    embed, lm_head = torch.randn(V, H), torch.randn(V, H)
    head = DraftHead(H, k=k, recurrent=True).eval()
    with torch.no_grad():
        head.out_norm.weight.uniform_(0.5, 1.5)  # a non-trivial norm weight to fold
    h, x = torch.randn(5, H), torch.tensor([1, 7, 9, 3, 0])
    full, _ = head.draft_greedy(h, x, embed, lm_head, k)
    head.vocab = torch.arange(V)
    got, _ = head.draft_greedy(h, x, embed, lm_head, k, readout=head.subset_readout(embed, lm_head))
    assert torch.equal(got, full)
    sub = torch.tensor(sorted(torch.randperm(V)[:12].tolist()))
    head.vocab = sub
    got, conf = head.draft_greedy(h, x, embed, lm_head, k, readout=head.subset_readout(embed, lm_head))
    assert bool(torch.isin(got, sub).all()) and conf.shape == (5, k)
    prev = torch.cat([x[:, None], got[:, :-1]], 1)  # the chain the subset drafts took
    logits, _ = head.forward_teacher(h, embed[x], embed[prev], lm_head)
    assert torch.equal(sub[logits[..., sub].argmax(-1)], got)
    p = tmp_path / "h.safetensors"
    head.save(str(p))
    assert torch.equal(DraftHead.load(str(p)).vocab, sub)
    top, cover = frequent_tokens([[7, 7, 5, 5, 5, 9, 1], [9, 5, 2]], [2, 0], 2, 10)  # prompts' tokens not counted
    assert top.tolist() == [5, 9] and abs(cover - 6 / 8) < 1e-6


def test_chat_prompt_set_is_distinct_and_holds_none_of_the_bench_prompts():
    """train-draft's 'chat' source (human-style requests) never reproduces a prompt bench/spec_decode.py measures on
    (its held-out chat / edit workloads), so bench numbers stay held-out."""
    import importlib.util
    import os

    from kestrel.spec.chat_prompts import chat_prompts
    p = chat_prompts()
    assert len(p) > 1000 and len(set(p)) == len(p) and chat_prompts(7, seed=0) == p[:7]
    assert chat_prompts(seed=1) != p and sorted(chat_prompts(seed=1)) == sorted(p)
    path = os.path.join(os.path.dirname(__file__), "..", "bench", "spec_decode.py")
    spec = importlib.util.spec_from_file_location("_spec_decode_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    held = {t.strip().lower() for texts in bench.WORKLOADS.values() for t in texts}
    assert held and not held & {t.lower() for t in p}


def test_train_head_checkpoints_during_training():
    """checkpoint_every: the callback gets the head in eval mode with its stats so far, more than once in a run
    long enough, and training goes on afterwards (the head is back in train mode and keeps changing)."""
    from kestrel.spec.train_draft import train_head
    torch.manual_seed(0)
    V, H = 40, 16
    embed, lm_head = torch.randn(V, H), torch.randn(V, H)
    seqs = [torch.randint(V, (30,)).tolist() for _ in range(4)]
    hidden = [torch.randn(len(s), H) for s in seqs]
    seen = []

    def ckpt(head, stats):
        assert not head.training and "steps" in stats
        seen.append((stats["steps"], head.slot.detach().clone()))
    head = train_head(embed, lm_head, hidden, seqs, k=2, steps=40, batch_positions=8, progress=False,
                      checkpoint=ckpt, checkpoint_every=1e-9)
    assert len(seen) >= 2 and seen[0][0] < seen[-1][0]
    assert not torch.equal(seen[0][1], seen[-1][1]) and not head.training


def test_train_head_on_the_clock_alone_runs_past_the_old_step_default():
    """steps=None with max_seconds: training ends on the clock, not on a step count (session 16's GPU head stopped at
    the then-default 500 steps after 12 s of a 50 s box); without max_seconds that is an error, and the CLI keeps 500
    steps when no time box is given."""
    import time

    from kestrel.cli import build_parser
    from kestrel.spec.train_cli import _check
    from kestrel.spec.train_draft import train_head
    torch.manual_seed(0)
    V, H = 40, 16
    embed, lm_head = torch.randn(V, H), torch.randn(V, H)
    seqs = [torch.randint(V, (30,)).tolist() for _ in range(4)]
    hidden = [torch.randn(len(s), H) for s in seqs]
    t0 = time.monotonic()
    head = train_head(embed, lm_head, hidden, seqs, k=2, steps=None, batch_positions=8, progress=False,
                      max_seconds=3.0)
    assert time.monotonic() - t0 >= 3.0 and head.train_stats["steps"] > 20
    with pytest.raises(ValueError, match="max_seconds"):
        train_head(embed, lm_head, hidden, seqs, k=2, steps=None, progress=False)
    p = build_parser()
    a = p.parse_args(["train-draft", "--max-seconds", "5"]); _check(a)
    assert a.steps is None
    a = p.parse_args(["train-draft"]); _check(a)
    assert a.steps == 500


def test_walk_tokens_per_verify_steps_over_accepted_prefixes():
    """The loop-like walk: from position 0 step over prefix + 1; at k = j the prefix is capped at j. Hand-counted:
    sequence [3, 0, 0, 0, 0, 1, 0] at k=4 visits 0 (4 tokens), 4 (1), 5 (2), end: 7 tokens / 3 steps; at k=1 it
    visits 0 (2), 2 (1), 3 (1), 4 (1), 5 (2): 7 / 5. The per-position mean differs (the walk skips positions)."""
    from kestrel.spec.acceptance import slot_stats, walk_tokens_per_verify
    pref = torch.tensor([3, 0, 0, 0, 0, 1, 0, 2, 2])
    w = walk_tokens_per_verify(pref, [7, 2], 4)
    # second sequence [2, 2]: k>=2 visits 0 (3 tokens), end; k=1 visits 0 (2), end
    assert w[0] == (7 + 2) / (5 + 1) and w[3] == (7 + 3) / (3 + 1) and w[1] == (3 + 1 + 1 + 2 + 3) / 5  # k=2: 0 (3), 3 (1), 4 (1), 5 (2); then 3
    st = slot_stats(pref, 4, [7, 2])
    assert st["walk"] == w and abs(st["tokens_per_verify"][3] - (1 + pref.float().mean().item())) < 1e-6


def test_draft_tree_paths_are_teacher_forced_chains():
    """DraftHead.draft_tree (the tree-verification ceiling of bench/draft_acceptance.py): widths of ones is exactly
    draft_greedy's chain (full and draft-vocabulary readout); with wider slots, path 0 is the greedy chain, the
    first tokens are the top-w of slot 1, and every path's token at slot i is the argmax (rank r of its width) of
    forward_teacher fed that path's own earlier tokens."""
    torch.manual_seed(0)
    H, V, k = 16, 50, 4
    embed, lm_head = torch.randn(V, H), torch.randn(V, H)
    head = DraftHead(H, k=k, recurrent=True).eval()
    h, x = torch.randn(3, H), torch.tensor([1, 7, 9])
    greedy, _ = head.draft_greedy(h, x, embed, lm_head, k)
    assert torch.equal(head.draft_tree(h, x, embed, lm_head, [1] * k)[:, 0], greedy)
    head.vocab = torch.arange(0, V, 2)
    ro = head.subset_readout(embed, lm_head)
    assert torch.equal(head.draft_tree(h, x, embed, lm_head, [1] * k, readout=ro)[:, 0],
                       head.draft_greedy(h, x, embed, lm_head, k, readout=ro)[0])
    head.vocab = None
    widths = [3, 2, 1, 1]
    t = head.draft_tree(h, x, embed, lm_head, widths)
    assert t.shape == (3, 6, k)
    assert torch.equal(t[:, 0], greedy)
    for p in range(6):
        prev = torch.cat([x[:, None], t[:, p, :-1]], 1)
        logits, _ = head.forward_teacher(h, embed[x], embed[prev], lm_head)
        ranks = [p // 2, p % 2, 0, 0]  # path p = (first token rank p // 2, second rank p % 2, greedy after)
        for i in range(k):
            assert torch.equal(logits[:, i].topk(widths[i], -1).indices[:, ranks[i]], t[:, p, i])
