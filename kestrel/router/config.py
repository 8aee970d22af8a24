"""Router settings (one dataclass so the CLI, tests and benches build the same thing)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RouterConfig:
    replicas: list[str] = field(default_factory=list)  # base URLs, e.g. http://127.0.0.1:8001
    prefill_replicas: list[str] = field(default_factory=list)  # P/D: replicas that only prefill
    decode_replicas: list[str] = field(default_factory=list)  # P/D: replicas that decode from handed-over KV
    policy: str = "score"  # "score" (weighted scorers) | "round_robin"
    weights: dict[str, float] | None = None  # scorer -> weight; None = scorers.DEFAULT_WEIGHTS
    qos: str = "wfq"  # "wfq" | "fifo"
    tenant_weights: dict[str, float] = field(default_factory=dict)
    api_keys: dict[str, str] = field(default_factory=dict)  # API key -> tenant
    max_inflight_per_replica: int = 4
    max_queued_per_tenant: int = 1000
    queue_timeout_s: float = 120.0
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 120.0  # longest silence tolerated from a replica mid-response
    health_interval_s: float = 1.0
    probe_timeout_s: float = 5.0  # a replica busy with a long prefill may answer /health slowly
    probe_failures_down: int = 3  # failed probes in a row (not refused connections) that mark a replica down
    max_attempts: int = 3  # replicas tried for a request that has not started streaming
    prefix_chunk_chars: int = 64
    prefix_index_entries: int = 200_000
    k8s_selector: str | None = None  # label selector for in-cluster pod discovery
    k8s_namespace: str | None = None
    k8s_port: int = 8000

    def validate(self) -> None:
        if not (self.replicas or self.k8s_selector or (self.prefill_replicas and self.decode_replicas)):
            raise ValueError("give at least one --replica URL (or --k8s-selector, or --prefill-replica and "
                             "--decode-replica)")
        if bool(self.prefill_replicas) != bool(self.decode_replicas):
            raise ValueError("P/D disaggregation needs both --prefill-replica and --decode-replica")
        if self.decode_replicas and self.replicas:
            raise ValueError("with P/D disaggregation give --prefill-replica and --decode-replica only (not --replica)")
        for url in [*self.replicas, *self.prefill_replicas, *self.decode_replicas]:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"replica URL must start with http:// or https://, got {url!r}")
        for name in ("max_inflight_per_replica", "max_attempts", "prefix_chunk_chars", "prefix_index_entries",
                     "max_queued_per_tenant", "probe_failures_down"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("queue_timeout_s", "connect_timeout_s", "read_timeout_s", "health_interval_s", "probe_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for t, w in self.tenant_weights.items():
            if w <= 0:
                raise ValueError(f"tenant weight must be > 0, got {t}={w}")
