"""Prometheus metrics. Engine state (queues, KV usage, prefix cache) is read from the engine's stats snapshot at
scrape time; per-request latencies and token counts are recorded by the request handlers. Each app gets its
own registry so several servers can live in one process (tests)."""
from __future__ import annotations

import time
from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    def __init__(self, stats_fn):
        self.stats_fn = stats_fn

    def collect(self):
        s = self.stats_fn()
        yield GaugeMetricFamily("kestrel_num_requests_running", "Requests in the running batch",
                                value=s.get("num_running", 0))
        yield GaugeMetricFamily("kestrel_num_requests_waiting", "Requests waiting to be scheduled",
                                value=s.get("num_waiting", 0))
        yield GaugeMetricFamily("kestrel_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1)",
                                value=s.get("kv_usage", 0.0))
        queries, hits = s.get("prefix_cache_queries", 0), s.get("prefix_cache_hits", 0)
        yield CounterMetricFamily("kestrel_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=queries)
        yield CounterMetricFamily("kestrel_prefix_cache_hits", "Prompt tokens served from the prefix cache",
                                  value=hits)
        yield GaugeMetricFamily("kestrel_prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries since start",
                                value=hits / queries if queries else 0.0)
        yield CounterMetricFamily("kestrel_num_preemptions", "Requests preempted for lack of KV blocks",
                                  value=s.get("num_preemptions", 0))
        if "spec_num_verifies" in s:  # speculative decoding is on
            yield CounterMetricFamily("kestrel_spec_decode_num_drafts", "Draft verifications (one per request-step)",
                                      value=s["spec_num_verifies"])
            yield CounterMetricFamily("kestrel_spec_decode_num_draft_tokens", "Draft tokens verified",
                                      value=s["spec_num_draft_tokens"])
            yield CounterMetricFamily("kestrel_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                      value=s["spec_num_accepted_tokens"])
            yield GaugeMetricFamily("kestrel_spec_decode_acceptance_rate", "Accepted / verified draft tokens",
                                    value=s["spec_acceptance_rate"])
            yield GaugeMetricFamily("kestrel_spec_decode_mean_accepted_length",
                                    "Tokens emitted per verification (accepted drafts + the target's own token)",
                                    value=s["spec_mean_accepted_length"])


class _PerTokenMetrics:
    """The two per-token series (ITL histogram, generated-token counter) as plain numbers: prometheus_client's
    Histogram.observe walks its buckets in Python and takes a lock per value, several us a token at hundreds of
    streams. Only the server's event loop writes these and the /metrics handler reads them on the same loop."""

    def __init__(self, model_name: str):
        self.labels = [model_name]
        self.bounds = list(_LATENCY_BUCKETS)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.itl_sum = 0.0
        self.tokens = 0

    def observe_itl(self, gap: float, n: int = 1) -> None:
        self.counts[bisect_left(self.bounds, gap)] += n  # le is inclusive, as in prometheus_client
        self.itl_sum += gap * n

    def collect(self):
        h = HistogramMetricFamily("kestrel_inter_token_latency_seconds", "Time between output tokens",
                                  labels=["model_name"])
        cum, buckets = 0, []
        for b, c in zip(self.bounds + [float("inf")], self.counts):
            cum += c
            buckets.append((floatToGoString(b), cum))
        h.add_metric(self.labels, buckets, self.itl_sum)
        yield h
        c = CounterMetricFamily("kestrel_generation_tokens", "Tokens generated", labels=["model_name"])
        c.add_metric(self.labels, self.tokens)
        yield c


class Metrics:
    def __init__(self, stats_fn, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats_fn))
        lbl = ["model_name"]
        r = self.registry
        self.ttft = Histogram("kestrel_time_to_first_token_seconds", "Time to first token", lbl,
                              buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.per_token = _PerTokenMetrics(model_name)
        r.register(self.per_token)
        self.e2e = Histogram("kestrel_e2e_request_latency_seconds", "Request latency, arrival to finish", lbl,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("kestrel_prompt_tokens", "Prompt tokens processed", lbl,
                                     registry=r).labels(model_name)
        self._finished = Counter("kestrel_request_finished", "Finished requests by reason (stop|length|abort|error)",
                                 lbl + ["finished_reason"], registry=r)
        self.model_name = model_name

    def request_finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Feeds TTFT / ITL / e2e histograms and token counters for one request."""

    def __init__(self, metrics: Metrics, prompt_tokens: int):
        self.m = metrics
        self.start = self.last = time.perf_counter()
        self.first = True
        self.m.prompt_tokens.inc(prompt_tokens)

    def on_tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        pt = self.m.per_token
        pt.tokens += n
        gaps = n
        if self.first:  # the first token's latency is TTFT, not ITL
            self.m.ttft.observe(now - self.start)
            self.first, gaps = False, n - 1
        if gaps:  # several tokens in one step (speculative decoding) share the interval evenly
            pt.observe_itl((now - self.last) / n, gaps)
        self.last = now

    def on_finish(self, reason: str | None) -> None:
        self.m.e2e.observe(time.perf_counter() - self.start)
        self.m.request_finished(reason or "abort")
