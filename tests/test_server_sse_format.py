"""The server's fast per-token paths against the generic ones they replace: pre-rendered SSE chunk templates and
hand-written completion logprobs against json.dumps(ensure_ascii=False), the loop-local ITL histogram against a
prometheus_client Histogram fed the same values."""
from __future__ import annotations

import json
import math
import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from kestrel.server.completions import _logprobs, _logprobs_json
from kestrel.server.metrics import _LATENCY_BUCKETS, _PerTokenMetrics
from kestrel.server.serving import RawJSON, SSETemplate

TOKENS = {1: "hello", 2: " world", 3: 'q"\\\n\t\u00e9\U0001F600', 4: "hello", 5: "", 6: "\x00\x1f</s>"}
VALUES = ["", "a b", 'x"y\\z\n', "\u00fc\u4e2d\U0001F600", None, 0, -3, 1.5, -math.inf, float("nan"), True,
          {"k": [1, None, "v"]}, [0.25, "s"]]


def dumps_sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def test_template_matches_json_dumps():
    rng = random.Random(0)

    def build(text, lp, reason, extra):
        return {"id": 'cmpl-"\u00e9"', "object": "text_completion", "created": 17, "model": "m/\u4e2d",
                "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": reason}], "usage": extra}

    t = SSETemplate(build, 4)
    for _ in range(500):
        vals = [rng.choice(VALUES) for _ in range(4)]
        assert t.render(*vals) == dumps_sse(build(*vals))
    # a value may sit anywhere, nested or not, in any order of the arguments
    t2 = SSETemplate(lambda a, b: {"outer": {"inner": [b, 1]}, "a": a}, 2)
    assert t2.render("x", None) == dumps_sse({"outer": {"inner": [None, 1]}, "a": "x"})
    assert t.render("t", RawJSON('{"tokens": []}'), None, None) == dumps_sse(build("t", {"tokens": []}, None, None))


def test_completion_logprobs_json_matches_json_dumps():
    rng = random.Random(1)
    ids = list(TOKENS)
    for _ in range(1000):
        entries = []
        for _ in range(rng.randint(0, 3)):
            e = {"token_id": rng.choice(ids),
                 "logprob": rng.choice([-rng.random() * 20, 0.0, -1e-30, -math.inf, float("nan")])}
            if rng.random() < 0.8:  # top may be missing, empty, or name two ids that decode alike (1 and 4)
                e["top"] = {rng.choice(ids): -rng.random() for _ in range(rng.randint(0, 4))}
            entries.append(e)
        off = rng.randint(0, 99)
        want = json.dumps(_logprobs(TOKENS.__getitem__, entries, off), ensure_ascii=False)
        assert _logprobs_json(TOKENS.__getitem__, entries, off) == want


def _samples(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith(name + "_created"):
            key, val = line.rsplit(" ", 1)
            out[key] = float(val)
    return out


def test_itl_histogram_matches_prometheus_client():
    rng = random.Random(2)
    ref_reg, our_reg = CollectorRegistry(), CollectorRegistry()
    ref = Histogram("kestrel_inter_token_latency_seconds", "Time between output tokens", ["model_name"],
                    buckets=_LATENCY_BUCKETS, registry=ref_reg).labels("m")
    ours = _PerTokenMetrics("m")
    our_reg.register(ours)
    # bucket edges exactly (le is inclusive), values between, beyond the last bucket, and repeated gaps
    values = list(_LATENCY_BUCKETS) + [rng.random() * 0.3 for _ in range(300)] + [0.0, 100.0]
    for v in values:
        n = rng.choice([1, 1, 1, 3])
        for _ in range(n):
            ref.observe(v)
        ours.observe_itl(v, n)
    name = "kestrel_inter_token_latency_seconds"
    a, b = _samples(generate_latest(ref_reg).decode(), name), _samples(generate_latest(our_reg).decode(), name)
    assert a.keys() == b.keys() and len(a) == len(_LATENCY_BUCKETS) + 3  # buckets incl. +Inf, _count, _sum
    for k in a:
        assert math.isclose(a[k], b[k], rel_tol=1e-9), k
