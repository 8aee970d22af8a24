"""Confidence scheduler: the verify budget shrinks as the batch grows (never a cliff), allocations are prefixes
chosen by survival probability; n-gram lookup and the --speculative parser."""
import numpy as np
import pytest
import torch

from kestrel.spec.config import parse_speculative
from kestrel.spec.ngram import NgramDrafter, ngram_lookup
from kestrel.spec.drafter import DraftInput
from kestrel.spec.scheduler import ConfidenceScheduler, FixedKScheduler


def test_budget_monotone_in_batch_size():
    s = ConfidenceScheduler(k_max=6, token_budget=48, min_survival=0.2)
    g = torch.Generator().manual_seed(0)
    pool = torch.rand(96, 6, generator=g) * 0.5 + 0.5
    lens = torch.randint(0, 7, (96,), generator=g)
    prev_k, prev_total, prev_thr = None, None, -1.0
    for B in range(1, 97):
        k = s.allocate(pool[:B], lens[:B])
        assert (k <= lens[:B]).all() and (k >= 0).all()
        total = int(k.sum())
        assert B + total <= max(B, 48)  # never more verify tokens than the budget (or 1 per request)
        assert total <= s.spare_budget(B)
        if B >= 48:
            assert total == 0 and s.max_k(B) == 0  # at high load speculation is off, plain decode
        if prev_k is not None:
            assert (k[: B - 1] <= prev_k).all()  # an existing request never gains draft tokens when load rises
            assert s.spare_budget(B) <= s.spare_budget(B - 1)
        assert s.threshold(B) >= prev_thr
        prev_k, prev_total, prev_thr = k, total, s.threshold(B)


def test_allocation_follows_survival():
    s = ConfidenceScheduler(k_max=4, token_budget=7, min_survival=0.0)
    conf = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.5, 0.5, 0.5, 0.5]])
    # B=2 -> 5 spare tokens; survivals row0 .9 .81 .73 .66, row1 .5 .25 .125 -> row0 gets 4, row1 gets 1
    assert s.allocate(conf, torch.tensor([4, 4])).tolist() == [4, 1]
    # a short draft limits its row; the freed budget goes to the next-best tokens
    assert s.allocate(conf, torch.tensor([2, 4])).tolist() == [2, 3]
    # the survival bar: tokens below it are never verified even with budget to spare
    s2 = ConfidenceScheduler(k_max=4, token_budget=64, min_survival=0.3)
    assert s2.allocate(conf, torch.tensor([4, 4])).tolist() == [4, 1]


def test_fixed_k():
    f = FixedKScheduler(1)
    assert f.allocate(torch.ones(3, 4), torch.tensor([4, 0, 2])).tolist() == [1, 0, 1]


def test_ngram_lookup_latest_longest_match():
    toks = np.array([1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3])
    # suffix (2,3): latest earlier match at index 5 -> continuation 4,5,7
    assert ngram_lookup(toks, 3, 3, 1) == [4, 5, 7]
    assert ngram_lookup(np.array([5, 6, 7]), 3, 3, 1) == []
    d = NgramDrafter()
    out = d.propose([DraftInput("a", [1, 2, 3, 1, 2]), DraftInput("b", [4])], 4)
    assert out.lens.tolist() == [4, 0] and out.tokens[0].tolist() == [3, 1, 2, 3]  # periodic wrap
    d.observe(["a"], [2], [0])
    assert d.rate["a"] < d.prior


def test_ngram_index_matches_full_rescan():
    """The incremental index proposes exactly what a full rescan (ngram_lookup) does, step by step."""
    from kestrel.spec.ngram import NgramIndex
    g = np.random.default_rng(0)
    for trial in range(20):
        toks = g.integers(0, 4 + trial % 5, size=3).tolist()
        idx = NgramIndex(3, 1)
        for _ in range(60):
            k = int(g.integers(1, 6))
            assert idx.lookup(toks, k) == ngram_lookup(np.array(toks), k, 3, 1)
            toks += g.integers(0, 4 + trial % 5, size=int(g.integers(1, 4))).tolist()


def test_parse_speculative():
    c = parse_speculative("drafter=ngram,k=4,schedule=fixed")
    assert (c.drafter, c.k, c.schedule) == ("ngram", 4, "fixed")
    assert parse_speculative("off") is None and parse_speculative("") is None
    for bad in ["k=0", "drafter=nope", "k=x", "garbage", "what=1", "drafter=head"]:
        with pytest.raises(ValueError):
            parse_speculative(bad)
