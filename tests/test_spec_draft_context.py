"""The draft head's optional context attention (DraftHead context=W): a head grown from a context-free one drafts
exactly as it did, the context changes drafts once trained, training windows hold the right past states (masked
before the first collected one), and the engine refuses a context head (the loop has no context yet)."""
import pytest
import torch

from kestrel.spec.draft_head import DraftHead
from kestrel.spec.train_draft import _Packed, _sample_batch, train_head

H, V = 32, 100


def _head(seed=0):
    torch.manual_seed(seed)
    return DraftHead(H, k=4, recurrent=True).eval()


def test_grown_head_drafts_as_before_until_its_context_is_trained():
    g = torch.Generator().manual_seed(1)
    embed, lm = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)
    hseq = torch.randn(40, H, generator=g)
    t = torch.arange(3, 38)
    x = torch.randint(V, (len(t),), generator=g)
    base = _head()
    grown = base.grown(6).eval()
    ctx, valid = grown.context_window(hseq, t, 6)
    assert valid[0].tolist() == [False, False, True, True, True, True] and valid[-1].all()
    assert torch.equal(ctx[5, -1], hseq[t[5]]) and torch.equal(ctx[5, 0], hseq[t[5] - 5])
    ref, _ = base.draft_greedy(hseq[t], x, embed, lm, 4)
    got, _ = grown.draft_greedy(hseq[t], x, embed, lm, 4, ctx=ctx, ctx_valid=valid)
    assert torch.equal(ref, got)
    tree = lambda h, **kw: h.draft_tree(hseq[t], x, embed, lm, [3, 2, 1], nodes=True, **kw)
    assert torch.equal(tree(base), tree(grown, ctx=ctx, ctx_valid=valid))
    torch.nn.init.normal_(grown.ctx_o.weight, std=1.0)
    moved, _ = grown.draft_greedy(hseq[t], x, embed, lm, 4, ctx=ctx, ctx_valid=valid)
    assert not torch.equal(ref, moved)  # the context reaches the drafts
    # masked positions are ignored: garbage there changes nothing
    ctx2 = ctx.clone()
    ctx2[~valid] = 1e3
    again, _ = grown.draft_greedy(hseq[t], x, embed, lm, 4, ctx=ctx2, ctx_valid=valid)
    assert torch.equal(moved, again)


def test_training_context_windows_and_learning(tmp_path):
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(V, (n,), generator=g).tolist() for n in (12, 30, 9)]
    plens = [5, 20, 3]
    full = [torch.cat([torch.tensor([[j, t] for t in range(len(s))], dtype=torch.float32),
                       torch.randn(len(s), H - 2, generator=g)], 1) for j, s in enumerate(seqs)]
    offs = [p - 1 for p in plens]
    p = _Packed([h[o:] for h, o in zip(full, offs)], seqs, "cpu", plens, offs)
    h, *_, ctx, valid = _sample_batch(p, 3, 128, torch.Generator().manual_seed(1), "cpu", context=4)
    for row in range(128):
        j, t = int(h[row, 0]), int(h[row, 1])
        for w in range(4):
            q = t - 3 + w
            assert bool(valid[row, w]) == (q >= offs[j])
            if q >= offs[j]:
                assert int(ctx[row, w, 0]) == j and int(ctx[row, w, 1]) == q
    embed, lm = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)
    head = _head().grown(4)
    trained = train_head(embed, lm, [h[o:] for h, o in zip(full, offs)], seqs, k=4, steps=5, batch_positions=32,
                         head=head, progress=False, prompt_lens=plens, hidden_offsets=offs)
    assert trained.ctx_o.weight.abs().sum() > 0  # the zero-initialised projection learned
    f = tmp_path / "ctx.safetensors"
    trained.save(str(f))
    back = DraftHead.load(str(f))
    assert back.context == 4 and torch.equal(back.ctx_kv.weight, trained.ctx_kv.weight)
    assert "context" not in _head().cfg  # context-free heads keep their old metadata


def test_engine_refuses_a_context_head(tmp_path):
    from kestrel.engine.llm_engine import LLMEngine
    f = tmp_path / "ctx.safetensors"
    DraftHead(64, k=3, recurrent=True, context=4).save(str(f))
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="offline-only"):
        LLMEngine(load_format="dummy", model_shape=shape, num_kv_blocks=32, block_size=4, progress=False,
                  speculative=f"drafter=head,head={f},k=3")


def test_train_draft_cli_grows_a_context_head_from_a_cached_run(tmp_path, capsys):
    """train-draft --init H --context 4: the saved head has the context attention and H's weights; --hidden-cache
    written by the first run is reused by the second (same sequences, no generation)."""
    import json

    from kestrel.cli import main
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1 2 3 4 5 1 2 3\n9 8 7 6\n3 1 4 1 5 9 2 6\n")
    torch.manual_seed(1)
    init = DraftHead(64, k=3, recurrent=True)
    init.save(str(tmp_path / "init.safetensors"))
    cache, out = tmp_path / "cache.pt", tmp_path / "ctx.safetensors"
    base = ["train-draft", "--load-format", "dummy", "--model-shape", json.dumps(shape), "--prompts", str(prompts),
            "--no-chat", "--num-prompts", "3", "--gen-tokens", "8", "--steps", "2", "--batch-positions", "16",
            "--lr", "1e-6", "--k", "3", "--out", str(out), "--no-progress", "--init", str(tmp_path / "init.safetensors"),
            "--context", "4", "--hidden-cache", str(cache), "--heldout", "0"]
    assert main(base) == 0 and cache.is_file()
    got = DraftHead.load(str(out))
    assert got.context == 4 and torch.allclose(got.slot, init.slot, atol=1e-3)
    capsys.readouterr()
    assert main(base + ["--freeze-base", "--lr", "1e-2"]) == 0
    assert "hidden states from" in capsys.readouterr().out  # loaded, not regenerated
    frozen = DraftHead.load(str(out))
    assert frozen.ctx_o.weight.abs().sum() > 0  # the context attention trained (lr 1e-2) ...
    for n, w in init.state_dict().items():  # ... the base head did not move (bf16-free: float32 save)
        assert torch.equal(frozen.state_dict()[n], w), n
