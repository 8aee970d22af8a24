"""What the router knows about one replica: health, its own in-flight count, load polled from the replica's
Prometheus /metrics, and an EWMA of observed time-to-first-token for latency prediction."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

# Several spellings are accepted so the router also fronts vLLM-style servers; the first one present wins.
METRIC_NAMES = {
    "running": ("kestrel_num_requests_running", "vllm:num_requests_running"),
    "waiting": ("kestrel_num_requests_waiting", "vllm:num_requests_waiting"),
    "kv_usage": ("kestrel_kv_cache_usage_perc", "kestrel_kv_cache_usage", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc"),
    "prefix_hits": ("kestrel_prefix_cache_hits_total", "kestrel_prefix_cache_hits", "vllm:prefix_cache_hits"),
    "prefix_queries": ("kestrel_prefix_cache_queries_total", "kestrel_prefix_cache_queries",
                       "vllm:prefix_cache_queries"),
}


def parse_metrics(text: str) -> dict[str, float]:
    """Sum every sample per metric name (labels such as model_name are ignored) and map to our keys."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[s.name] = samples.get(s.name, 0.0) + float(s.value)
    out = {}
    for key, names in METRIC_NAMES.items():
        for n in names:
            if n in samples:
                out[key] = samples[n]
                break
    return out


@dataclass
class Replica:
    url: str
    role: str = "both"  # "both" | "prefill" | "decode" (P/D disaggregation)
    healthy: bool = True  # optimistic until the first failed probe; a failed request marks it down at once
    inflight: int = 0  # requests the router has dispatched and not yet finished
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    prefix_hits: float = 0.0
    prefix_queries: float = 0.0
    ttft_ewma: float | None = None  # seconds
    consecutive_failures: int = 0
    probe_failures: int = 0  # failed /health probes in a row
    last_error: str = ""
    last_poll: float = 0.0
    down_since: float | None = None
    stats: dict = field(default_factory=lambda: {"dispatched": 0, "failed": 0})

    def __post_init__(self):
        self.url = self.url.rstrip("/")

    @property
    def queue_depth(self) -> float:
        # The replica's own numbers lag one poll behind; our in-flight count is exact for our own traffic.
        return max(self.running + self.waiting, float(self.inflight))

    def update_metrics(self, m: dict[str, float]) -> None:
        for k, v in m.items():
            setattr(self, k, v)
        if self.kv_usage > 1.0:  # some servers publish a percentage
            self.kv_usage /= 100.0
        self.last_poll = time.monotonic()

    def observe_ttft(self, seconds: float, alpha: float = 0.2) -> None:
        self.ttft_ewma = seconds if self.ttft_ewma is None else (1 - alpha) * self.ttft_ewma + alpha * seconds

    def mark_down(self, reason: str) -> None:
        if self.healthy:
            self.down_since = time.monotonic()
        self.healthy = False
        self.last_error = reason
        self.consecutive_failures += 1

    def mark_up(self) -> None:
        self.healthy = True
        self.down_since = None
        self.consecutive_failures = 0

    def describe(self) -> dict:
        return {"url": self.url, "role": self.role, "healthy": self.healthy, "inflight": self.inflight,
                "running": self.running, "waiting": self.waiting, "kv_usage": self.kv_usage,
                "ttft_ewma_s": self.ttft_ewma, "last_error": self.last_error, **self.stats}
