"""Router logic without processes: the approximate prefix index, the scorers and the picker."""
import hashlib

import pytest

from kestrel.router.prefix_index import PrefixIndex, chunk_hashes
from kestrel.router.replica import Replica, parse_metrics
from kestrel.router.scorers import Picker, parse_weights


def test_chunk_hashes_chain_whole_prefix():
    a = chunk_hashes("x" * 10 + "y" * 10 + "z" * 5, 10)
    # independent reference: hash i covers the whole prefix up to chunk i (blake2b of prev digest + chunk)
    prev, ref = b"", []
    for c in ("x" * 10, "y" * 10):
        prev = hashlib.blake2b(prev + c.encode(), digest_size=12).digest()
        ref.append(prev)
    assert a == ref  # the 5-char tail is not a full chunk
    # same second chunk after a different first chunk -> different hash
    b = chunk_hashes("w" * 10 + "y" * 10, 10)
    assert b[1] != a[1]


def test_index_match_longest_prefix_and_lru_bound():
    idx = PrefixIndex(chunk_chars=4, max_entries=6)
    sys_prompt = "SYS:abcdefgh"  # 3 chunks
    idx.insert(idx.hashes(sys_prompt + "q1q1"), "A")  # 4 chunks on A
    idx.insert(idx.hashes(sys_prompt[:4]), "B")  # 1 chunk on B
    m = idx.match(idx.hashes(sys_prompt + "q2q2"), ["A", "B", "C"])
    assert m == {"A": 3, "B": 1, "C": 0}
    assert len(idx) == 5
    idx.insert(idx.hashes("zzzzyyyy"), "C")  # 2 more entries -> 7 > 6: the least recently used goes
    assert len(idx) == 6
    # B's insert refreshed the first chunk, so the least recently used entry was A's second chunk:
    # A's chain now breaks after one chunk
    assert idx.match(idx.hashes(sys_prompt), ["A"])["A"] == 1
    idx.forget_replica("C")
    assert idx.match(idx.hashes("zzzzyyyy"), ["C"])["C"] == 0


def _replicas(n):
    return [Replica(f"http://r{i}") for i in range(n)]


def test_picker_prefers_replica_holding_prefix_then_balances_load():
    idx = PrefixIndex(chunk_chars=8)
    picker = Picker(idx)
    reps = _replicas(3)
    doc = "shared system prompt " * 20
    idx.insert(idx.hashes(doc), reps[2].url)
    ctx = picker.context(idx.hashes(doc + "question one"), reps)
    assert picker.pick(ctx, reps) is reps[2]
    # with no prefix anywhere, the least-loaded replica wins
    reps[0].inflight, reps[1].inflight, reps[2].inflight = 3, 0, 3
    ctx = picker.context(idx.hashes("unrelated " * 30), reps)
    assert picker.pick(ctx, reps) is reps[1]
    # prefix affinity loses when its replica is saturated and the KV of that replica is full
    reps[2].inflight, reps[2].kv_usage = 40, 1.0
    reps[0].inflight = 0
    ctx = picker.context(idx.hashes(doc + "q"), reps)
    assert picker.pick(ctx, reps) is not reps[2]


def test_round_robin_and_weights_parsing():
    idx = PrefixIndex()
    reps = _replicas(3)
    rr = Picker(idx, policy="round_robin")
    ctx = rr.context([], reps)
    assert [rr.pick(ctx, reps).url for _ in range(6)] == [r.url for r in reps] * 2
    assert parse_weights("prefix=1,queue=0.5") == {"prefix": 1.0, "queue": 0.5, "kv": 0.0, "latency": 0.0}
    for bad in ("prefix", "nope=1", "queue=x", "kv=-1"):
        with pytest.raises(ValueError):
            parse_weights(bad)
    with pytest.raises(ValueError):
        Picker(idx, policy="random")


def test_parse_metrics_reads_server_names():
    text = ("# TYPE kestrel_num_requests_running gauge\nkestrel_num_requests_running{model_name=\"m\"} 3\n"
            "# TYPE kestrel_num_requests_waiting gauge\nkestrel_num_requests_waiting 2\n"
            "# TYPE kestrel_kv_cache_usage_perc gauge\nkestrel_kv_cache_usage_perc 0.25\n"
            "# TYPE kestrel_prefix_cache_hits counter\nkestrel_prefix_cache_hits_total 96\n")
    m = parse_metrics(text)
    assert m == {"running": 3.0, "waiting": 2.0, "kv_usage": 0.25, "prefix_hits": 96.0}
    r = Replica("http://x/")
    r.update_metrics(m)
    assert r.url == "http://x" and r.queue_depth == 5.0


def test_k8s_discovery_keeps_ready_pods_only():
    from kestrel.router.discovery import ready_pod_urls

    def pod(ip, ready, deleting=False):
        meta = {"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {}
        return {"metadata": meta, "status": {"podIP": ip, "conditions": [
            {"type": "Ready", "status": "True" if ready else "False"}]}}
    pods = {"items": [pod("10.0.0.2", True), pod("10.0.0.3", False), pod("10.0.0.4", True, deleting=True),
                      {"metadata": {}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}},
                      pod("10.0.0.1", True)]}
    assert ready_pod_urls(pods, 8000) == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
