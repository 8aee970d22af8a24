"""Replica scorers, each mapping replicas to [0, 1] (higher = better), combined with weights (the llm-d design:
prefix-cache affinity, queue depth, KV utilisation, predicted latency). The picker takes the best weighted sum."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from kestrel.router.prefix_index import PrefixIndex
from kestrel.router.replica import Replica


@dataclass
class RouteContext:
    prompt_hashes: list[bytes]
    prefix_matches: dict[str, int]  # replica url -> leading chunks believed cached there


def _min_max_inverse(values: dict[str, float]) -> dict[str, float]:
    """Lowest value -> 1, highest -> 0; all equal -> 1 for everyone."""
    lo, hi = min(values.values()), max(values.values())
    if hi - lo < 1e-9:
        return {k: 1.0 for k in values}
    return {k: (hi - v) / (hi - lo) for k, v in values.items()}


def prefix_scorer(ctx: RouteContext, replicas: list[Replica]) -> dict[str, float]:
    n = len(ctx.prompt_hashes)
    return {r.url: (ctx.prefix_matches.get(r.url, 0) / n if n else 0.0) for r in replicas}


def queue_scorer(ctx: RouteContext, replicas: list[Replica]) -> dict[str, float]:
    return _min_max_inverse({r.url: r.queue_depth for r in replicas})


def kv_util_scorer(ctx: RouteContext, replicas: list[Replica]) -> dict[str, float]:
    return {r.url: max(0.0, 1.0 - r.kv_usage) for r in replicas}


def predicted_latency(ctx: RouteContext, r: Replica, default_ttft: float = 0.05) -> float:
    """TTFT model: the replica's observed TTFT, times the queue ahead of us, scaled by how much of the prompt must
    be prefilled (a fully cached prefix still pays a floor for scheduling and the last block)."""
    n = len(ctx.prompt_hashes)
    uncached = 1.0 - (ctx.prefix_matches.get(r.url, 0) / n if n else 0.0)
    base = r.ttft_ewma if r.ttft_ewma is not None else default_ttft
    return base * (1.0 + r.queue_depth) * (0.2 + 0.8 * uncached)


def latency_scorer(ctx: RouteContext, replicas: list[Replica]) -> dict[str, float]:
    # a replica not yet observed is assumed typical, so it neither attracts nor repels traffic
    seen = [r.ttft_ewma for r in replicas if r.ttft_ewma is not None]
    typical = sum(seen) / len(seen) if seen else 0.05
    preds = {r.url: predicted_latency(ctx, r, typical) for r in replicas}
    best = min(preds.values())
    return {k: (best / v if v > 0 else 1.0) for k, v in preds.items()}


SCORERS = {"prefix": prefix_scorer, "queue": queue_scorer, "kv": kv_util_scorer, "latency": latency_scorer}
DEFAULT_WEIGHTS = {"prefix": 3.0, "queue": 2.0, "kv": 1.0, "latency": 1.0}


def parse_weights(spec: str | None) -> dict[str, float]:
    """'prefix=3,queue=2' -> weights; unnamed scorers get 0 when a spec is given."""
    if not spec:
        return dict(DEFAULT_WEIGHTS)
    weights = {k: 0.0 for k in SCORERS}
    for part in spec.split(","):
        name, sep, val = part.partition("=")
        name = name.strip()
        if not sep or name not in SCORERS:
            raise ValueError(f"bad scorer weight {part!r}: expected NAME=WEIGHT with NAME in {sorted(SCORERS)}")
        try:
            weights[name] = float(val)
        except ValueError:
            raise ValueError(f"bad scorer weight {part!r}: {val!r} is not a number") from None
        if weights[name] < 0:
            raise ValueError(f"scorer weight must be >= 0, got {part!r}")
    return weights


class Picker:
    """policy 'score' (weighted scorers) or 'round_robin' (the baseline)."""

    def __init__(self, index: PrefixIndex, weights: dict[str, float] | None = None, policy: str = "score"):
        if policy not in ("score", "round_robin"):
            raise ValueError(f"unknown routing policy {policy!r}: use 'score' or 'round_robin'")
        self.index, self.policy = index, policy
        self.weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
        self._rr = itertools.count()

    def context(self, prompt_hashes: list[bytes], replicas: list[Replica]) -> RouteContext:
        return RouteContext(prompt_hashes, self.index.match(prompt_hashes, [r.url for r in replicas]))

    def scores(self, ctx: RouteContext, replicas: list[Replica]) -> dict[str, float]:
        total = {r.url: 0.0 for r in replicas}
        for name, w in self.weights.items():
            if w:
                for url, s in SCORERS[name](ctx, replicas).items():
                    total[url] += w * s
        return total

    def pick(self, ctx: RouteContext, replicas: list[Replica]) -> Replica:
        if not replicas:
            raise LookupError("no replica available")
        turn = next(self._rr)
        if self.policy == "round_robin":
            return replicas[turn % len(replicas)]
        total = self.scores(ctx, replicas)
        # ties (e.g. a cold start) rotate so equal replicas share the load
        n = len(replicas)
        order = [replicas[(turn + i) % n] for i in range(n)]
        return max(order, key=lambda r: total[r.url])
