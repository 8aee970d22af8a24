"""`kestrel serve` (a subprocess on the embedded SmolLM2) against the official openai client and raw HTTP:
completions + chat, streaming + not, concurrency, 400/401 errors, /metrics, and abort on client disconnect."""
from __future__ import annotations

import asyncio
import json
import re
import time
import uuid

import httpx
import openai
import pytest

from conftest import kestrel_server

KEY = "test-key"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server():
    with kestrel_server("--api-key", KEY, "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-gb", "0.05",
                        "--max-num-seqs", "32") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def metric(server, name: str, **labels) -> float:
    """Sum of the samples of one metric whose labels include `labels`."""
    text = httpx.get(server.url + "/metrics").text
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def test_health_and_models(server, client, model):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert "SmolLM2" in model
    assert [m.id for m in client.models.list().data] == [model]


def test_completion_stream_equals_non_stream(client, model):
    prompt = "The three primary colors are"
    full = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    choice = full.choices[0]
    assert choice.finish_reason in ("length", "stop")
    assert full.usage.prompt_tokens > 0 and full.usage.total_tokens == full.usage.prompt_tokens + \
        full.usage.completion_tokens
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text and text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_stream_equals_non_stream(client, model):
    messages = [{"role": "user", "content": "Name a fruit."}]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_prompt_uses_chat_template(server, client, model):
    # The template adds SmolLM2's default system turn; the prompt must be far longer than the bare message.
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert r.usage.prompt_tokens > 10
    r2 = client.completions.create(model=model, prompt="Hi", max_tokens=1)
    assert r2.usage.prompt_tokens < 5


def test_stop_string_truncates(client, model):
    prompt = "1, 2, 3, 4, 5,"
    free = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    words = free.split()
    assert len(words) >= 3, free
    stop = words[2]
    r = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, stop=[stop]).choices[0]
    assert r.finish_reason == "stop"
    assert r.text == free[: free.index(stop)]


def test_logprobs(client, model):
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, lp_tok, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and lp_tok <= 0.0
        assert lp_tok == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the likeliest token
    c = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4)
               for t in content)


def test_seed_makes_sampling_reproducible(client, model):
    kw = dict(model=model, prompt="My favourite animal is", max_tokens=10, temperature=1.0, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


def test_32_concurrent_streams_complete(server, client, model):
    prompts = ["The sky is", "Water boils at", "The largest planet is", "A cat is"]
    refs = {p: client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0).choices[0].text
            for p in prompts}

    async def one(aclient, p):
        text, reason = "", None
        stream = await aclient.completions.create(model=model, prompt=p, max_tokens=8, temperature=0, stream=True)
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return p, text, reason

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, prompts[i % 4]) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32
    for p, text, reason in results:
        assert reason in ("length", "stop")
        assert text == refs[p]  # batched greedy decoding == one request at a time


def test_api_key_required(server, model):
    body = {"model": model, "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server.url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401


BAD = [
    ("completions", b"{not json", "body"),
    ("completions", b"[1, 2]", "body"),
    ("completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 10 * MAX_MODEL_LEN}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("completions", {"prompt": "hello " * (2 * MAX_MODEL_LEN)}, "prompt"),
    ("completions", {"prompt": "hi", "model": "no-such-model"}, "model"),
    ("completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": "hi", "top_k": -7}, "top_k"),
    ("completions", {"prompt": "hi", "presence_penalty": 9}, "presence_penalty"),
    ("completions", {"prompt": "hi", "logprobs": 99}, "logprobs"),
    ("completions", {"prompt": "hi", "n": 3}, "n"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": [10**9]}, "prompt"),
    ("completions", {"max_tokens": 3}, "prompt"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi " * (2 * MAX_MODEL_LEN)}]}, "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True, "top_p": 0}, "top_p"),
]


@pytest.mark.parametrize("endpoint,body,param", BAD, ids=[f"{e}-{p}-{i}" for i, (e, _, p) in enumerate(BAD)])
def test_bad_request_is_400(server, model, endpoint, body, param):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    if isinstance(body, dict):
        body = json.dumps({"model": model, **body}).encode()
    r = httpx.post(f"{server.url}/v1/{endpoint}", content=body, headers=headers, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param != "body":
        assert err["param"] == param or param in err["message"], err


def test_prefix_cache_hit_rate_rises_on_repeated_prompt(server, client, model):
    # A fresh prompt several blocks long, sent twice: the second time its full blocks come from the cache.
    prompt = f"Request {uuid.uuid4().hex}: " + "tell me about the history of tea in many words, " * 8
    client.completions.create(model=model, prompt=prompt, max_tokens=1)
    rate_before = metric(server, "kestrel_prefix_cache_hit_rate")
    hits_before = metric(server, "kestrel_prefix_cache_hits_total")
    r = client.completions.create(model=model, prompt=prompt, max_tokens=1)
    assert metric(server, "kestrel_prefix_cache_hits_total") - hits_before >= 16 * 3
    assert metric(server, "kestrel_prefix_cache_hit_rate") > rate_before
    assert r.usage.prompt_tokens_details.cached_tokens >= 16 * 3


def test_metrics_exposes_engine_and_latency(server, client, model):
    client.completions.create(model=model, prompt="Metrics test", max_tokens=3, temperature=0)
    for name in ("kestrel_num_requests_running", "kestrel_num_requests_waiting", "kestrel_kv_cache_usage_perc",
                 "kestrel_time_to_first_token_seconds_count", "kestrel_inter_token_latency_seconds_count",
                 "kestrel_prompt_tokens_total", "kestrel_generation_tokens_total"):
        assert name in httpx.get(server.url + "/metrics").text
    assert metric(server, "kestrel_time_to_first_token_seconds_count") >= 1
    assert metric(server, "kestrel_inter_token_latency_seconds_count") >= 2
    assert metric(server, "kestrel_generation_tokens_total") >= 3


def wait_for(pred, what: str, timeout: float = 120.0):
    # A hang guard, not a performance threshold.
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_client_disconnect_mid_stream_frees_kv_blocks(server, model, endpoint):
    stats = lambda: httpx.get(server.url + "/stats").json()  # noqa: E731
    wait_for(lambda: stats()["num_running"] == 0 and stats()["num_waiting"] == 0, "an idle engine")
    free_before = stats()["num_free_kv_blocks"]
    aborts_before = metric(server, "kestrel_request_finished_total", finished_reason="abort")
    body = {"model": model, "max_tokens": MAX_MODEL_LEN - 64, "ignore_eos": True, "stream": True}
    body.update({"prompt": "Count: one two three"} if endpoint == "completions"
                else {"messages": [{"role": "user", "content": "Count to a thousand."}]})
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{server.url}/v1/{endpoint}", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    held = stats()
                    break  # leaving the iterator closes the connection
    assert held["num_running"] == 1 and held["num_free_kv_blocks"] < free_before  # it held blocks while streaming
    # Connection closed long before max_tokens: the server must abort the request and free its blocks.
    wait_for(lambda: stats()["num_running"] == 0, "the aborted request to leave the batch")
    assert stats()["num_free_kv_blocks"] == free_before
    assert metric(server, "kestrel_request_finished_total", finished_reason="abort") == aborts_before + 1


def test_client_disconnect_without_streaming_aborts(server, model):
    """A non-streaming client that gives up (here: closes the socket once generation has started) frees the
    request's blocks too, instead of the server generating all max_tokens for nobody."""
    stats = lambda: httpx.get(server.url + "/stats").json()  # noqa: E731
    wait_for(lambda: stats()["num_running"] == 0 and stats()["num_waiting"] == 0, "an idle engine")
    free_before = stats()["num_free_kv_blocks"]
    aborts_before = metric(server, "kestrel_request_finished_total", finished_reason="abort")
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": MAX_MODEL_LEN - 64, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            task = asyncio.ensure_future(c.post(f"{server.url}/v1/completions", json=body,
                                                headers={"Authorization": f"Bearer {KEY}"}))
            while stats()["num_running"] == 0:  # wait until it is generating
                await asyncio.sleep(0.05)
            held = stats()
            task.cancel()  # drops the connection
            with pytest.raises(asyncio.CancelledError):
                await task
            return held

    held = asyncio.run(main())
    assert held["num_free_kv_blocks"] < free_before
    wait_for(lambda: stats()["num_running"] == 0, "the abandoned request to be aborted")
    assert stats()["num_free_kv_blocks"] == free_before
    assert metric(server, "kestrel_request_finished_total", finished_reason="abort") == aborts_before + 1
