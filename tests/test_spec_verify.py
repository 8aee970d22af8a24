"""Lossless verification: greedy is exactly the target's argmax chain; rejection sampling reproduces the target's
distribution (chi-square against the exact target joint law), and a wrong residual is caught by the same test."""
import pytest
import torch

import kestrel.spec.verify as V
from kestrel.spec.verify import verify_greedy, verify_sampling


def chi2_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with zero expected mass must have zero counts."""
    n = counts.sum()
    counts, expected_probs = counts.flatten().double(), expected_probs.flatten().double()
    zero = expected_probs == 0
    if counts[zero].sum() > 0:
        return 0.0
    exp = expected_probs[~zero] * n
    stat = ((counts[~zero] - exp) ** 2 / exp).sum()
    df = int((~zero).sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.double), stat / 2))  # chi2 survival


def _markov(V_, seed, zeros=False):
    g = torch.Generator().manual_seed(seed)
    M = torch.rand(V_, V_, generator=g) ** 3
    if zeros:  # like top-k truncation: some tokens impossible under the target
        M[:, -1] = 0
    return M / M.sum(1, keepdim=True)


def _run_chain(P, Q, n_rows, deterministic, gen, max_k=3, n_tokens=2):
    """Generate n_tokens per row by repeated draft+verify steps with random per-row draft lengths (0..max_k)."""
    B = n_rows
    last = torch.zeros(B, dtype=torch.long)
    out = torch.full((B, n_tokens + max_k + 1), -1, dtype=torch.long)
    n_out = torch.zeros(B, dtype=torch.long)
    rows = torch.arange(B)
    while (n_out < n_tokens).any():
        act = rows[n_out < n_tokens]
        b = act.numel()
        lens = torch.randint(0, max_k + 1, (b,), generator=gen)
        toks = torch.zeros(b, max_k, dtype=torch.long)
        qprobs = torch.zeros(b, max_k, P.shape[0])
        prev = last[act]
        prevs = [prev]
        for i in range(max_k):
            q = Q[prev]
            nxt = q.argmax(1) if deterministic else torch.multinomial(q, 1, generator=gen).squeeze(1)
            toks[:, i], qprobs[:, i] = nxt, q
            prev = nxt
            prevs.append(prev)
        tprobs = torch.stack([P[p] for p in prevs], dim=1)  # target given the drafted prefix
        emitted, a = verify_sampling(toks, lens, tprobs, None if deterministic else qprobs, generator=gen)
        assert (a <= lens).all()
        for j in range(max_k + 1):
            m = j <= a
            r = act[m]
            out[r, n_out[r]] = emitted[m, j]
            n_out[r] += 1
        last[act] = emitted[torch.arange(b), a]
    return out[:, :n_tokens]


def _joint_counts(seq, V_):
    return torch.bincount(seq[:, 0] * V_ + seq[:, 1], minlength=V_ * V_).reshape(V_, V_)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("zeros", [False, True])
def test_rejection_sampling_matches_target_joint(deterministic, zeros):
    V_ = 5
    P, Q = _markov(V_, 1, zeros), _markov(V_, 2)
    gen = torch.Generator().manual_seed(123)
    seq = _run_chain(P, Q, 30000, deterministic, gen)
    expected = P[0][:, None] * P  # x1 ~ P[0], x2 ~ P[x1]
    assert chi2_pvalue(_joint_counts(seq, V_), expected) > 1e-3


def test_wrong_residual_is_detected(monkeypatch):
    """Resampling from p instead of normalize(max(0, p - q)) biases the output; the same test must fail."""
    V_ = 5
    P, Q = _markov(V_, 1), _markov(V_, 2)
    monkeypatch.setattr(V, "residual_distribution", lambda p, q: p)
    gen = torch.Generator().manual_seed(123)
    seq = _run_chain(P, Q, 30000, False, gen)
    assert chi2_pvalue(_joint_counts(seq, V_), P[0][:, None] * P) < 1e-6


def test_draft_equal_to_target_always_accepted():
    V_ = 7
    P = _markov(V_, 3)
    B, K = 64, 4
    gen = torch.Generator().manual_seed(0)
    toks = torch.multinomial(P[0], B * K, replacement=True, generator=gen).reshape(B, K)
    tp = P[0].expand(B, K + 1, V_).clone()
    _, a = verify_sampling(toks, torch.full((B,), K), tp, P[0].expand(B, K, V_), generator=gen)
    assert (a == K).all()


def test_greedy_longest_prefix_and_padding():
    draft = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 2, 3], [4, 4, 4]])
    lens = torch.tensor([3, 3, 2, 0])
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 9], [4, 4, 4, 4]])
    out, a = verify_greedy(draft, lens, target)
    assert a.tolist() == [3, 1, 2, 0]
    assert out.tolist() == [[5, 6, 7, 8], [5, 6, -1, -1], [1, 2, 3, -1], [4, -1, -1, -1]]


def test_greedy_chain_equals_argmax_chain():
    """Greedy spec over a deterministic toy 'model' (argmax of a Markov chain) with random, often wrong drafts
    produces the same sequence as plain greedy decoding."""
    V_ = 11
    P = _markov(V_, 4)
    nxt = P.argmax(1)
    gen = torch.Generator().manual_seed(5)
    ref = [0]
    for _ in range(40):
        ref.append(int(nxt[ref[-1]]))
    seq = [0]
    while len(seq) < 41:
        k = int(torch.randint(0, 5, (1,), generator=gen))
        draft = []
        prev = seq[-1]
        for _ in range(k):  # draft that is right most of the time
            d = int(nxt[prev]) if torch.rand(1, generator=gen) < 0.7 else int(torch.randint(0, V_, (1,), generator=gen))
            draft.append(d)
            prev = d
        ctx = [seq[-1]] + draft
        target = torch.tensor([[int(nxt[t]) for t in ctx]])
        d = torch.tensor([draft + [0] * (4 - k)]) if k < 4 else torch.tensor([draft])
        target = torch.cat([target, target.new_zeros(1, 5 - target.shape[1])], 1)
        out, a = verify_greedy(d, torch.tensor([k]), target)
        seq.extend(out[0, : int(a) + 1].tolist())
    assert seq[:41] == ref
