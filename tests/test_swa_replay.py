"""SWA bounded replay vs full recompute on tiny random Mistral-like / hybrid models (CPU, float32).

The reference is an independent dense forward of the whole sequence with per-layer causal (+window) masks;
the replay path keeps only W-1 keys per SWA layer and rebuilds them from the prefix's last R tokens."""
import pytest
import torch
import torch.nn.functional as F

from kestrel.engine.swa_replay import exact_replay_tokens, prefill, resume, run_tokens
from kestrel.model.dummy import build_dummy_model, dummy_config

W = 4


class _DenseRef:
    def __init__(self, swa_layers, n):
        self.swa_layers, self.pos = swa_layers, torch.arange(n)

    def attention(self, layer, q, k, v):
        mask = self.pos[None, :] <= self.pos[:, None]
        if layer in self.swa_layers:
            mask &= self.pos[:, None] - self.pos[None, :] < W
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                           enable_gqa=True)
        return o.transpose(0, 1).reshape(q.shape[0], -1)


def _model(num_layers, seed):
    cfg, _ = dummy_config(dict(architecture="mistral", vocab_size=64, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               max_position_embeddings=128, sliding_window=W))
    return build_dummy_model(cfg, torch.float32, "cpu", seed=seed, std=0.3)  # large weights: layers really mix


def _reference(model, ids, swa_layers):
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(len(ids)), _DenseRef(swa_layers, len(ids))))


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("num_layers,swa_layers", [(3, {0, 1, 2}), (4, {1, 3}), (3, {1})])
def test_resume_with_exact_replay_equals_full_prefill(num_layers, swa_layers):
    model = _model(num_layers, seed=num_layers)
    ids = torch.randint(0, 64, (31,), generator=torch.Generator().manual_seed(1))
    P = 20
    ref = _reference(model, ids, swa_layers)
    # the prefix was computed earlier (cold prefill); only its full-attention K/V went to the prefix cache
    _, cold = prefill(model, ids[:P], W, swa_layers)
    cached_full = dict(cold.full)
    logits, kv = resume(model, ids, P, cached_full, W, swa_layers)
    assert _rel(logits, ref[P:]) < 1e-5
    assert kv.swa_tokens() <= W - 1  # bounded SWA state, not full length
    assert all(kv.full[i][0].shape[0] == len(ids) for i in range(num_layers) if i not in swa_layers)
    # decoding on from the resumed state stays exact
    nxt = torch.cat([ids, logits[-1:].argmax(-1)])
    step = run_tokens(model, nxt[-1:], len(ids), kv, swa_layers)
    assert _rel(step, _reference(model, nxt, swa_layers)[-1:]) < 1e-5


def test_replaying_only_window_tokens_is_exact_with_one_swa_layer():
    model = _model(3, seed=5)
    ids = torch.randint(0, 64, (26,), generator=torch.Generator().manual_seed(2))
    _, cold = prefill(model, ids[:17], W, {2})
    logits, _ = resume(model, ids, 17, cold.full, W, {2}, replay_tokens=W)
    assert _rel(logits, _reference(model, ids, {2})[17:]) < 1e-5


def test_too_short_replay_is_detected_as_inexact():
    """Negative control: with 3 stacked SWA layers, replaying only W tokens misses the receptive field."""
    model = _model(3, seed=3)
    ids = torch.randint(0, 64, (31,), generator=torch.Generator().manual_seed(1))
    assert exact_replay_tokens(W, 3) == 9 > W
    logits, _ = resume(model, ids, 20, {}, W, {0, 1, 2}, replay_tokens=W)
    assert _rel(logits, _reference(model, ids, {0, 1, 2})[20:]) > 1e-3


def test_resume_rejects_missing_cache():
    model = _model(2, seed=0)
    ids = torch.arange(10)
    with pytest.raises(ValueError, match="full-attention layer 0"):
        resume(model, ids, 5, {}, W, {1})
    with pytest.raises(ValueError, match="shorter than the request"):
        resume(model, ids, 10, {}, W, {0, 1})
