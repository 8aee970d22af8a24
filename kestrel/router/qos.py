"""Multi-tenant QoS in the router: who a request belongs to, how urgent it is, and in what order queued requests
get a replica slot.

Ordering is start-time fair queueing (virtual time): a tenant's request gets start tag S = max(V, F_prev) and
finish tag F = S + cost / weight; the queue serves the smallest finish tag, and V advances to the start tag of what
it served. A tenant that floods the queue only pushes its *own* tags into the future, so another tenant's next
request is served after at most about one request per other backlogged tenant. Priority classes sit on top:
interactive requests are served before batch ones. Per-replica concurrency limits make the router (not the replica
queues) the place where waiting happens, which is what lets the ordering matter.
"""
from __future__ import annotations

import asyncio
import hashlib
import heapq
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

from kestrel.router.replica import Replica

PRIORITY_CLASSES = {"interactive": 0, "batch": 1}


def tenant_of(headers, api_keys: dict[str, str]) -> str:
    """X-Tenant header, else the tenant mapped to the API key, else a stable id derived from the key."""
    t = headers.get("x-tenant")
    if t:
        return t.strip()[:64]
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        key = auth[7:].strip()
        if key:
            return api_keys.get(key) or "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
    return "default"


def priority_of(headers, body: dict) -> str:
    """'interactive' (default) or 'batch', from the X-Priority header or the body's 'priority' field (a class name,
    or an int as in vLLM where larger means less urgent)."""
    p = headers.get("x-priority", body.get("priority", "interactive"))
    if isinstance(p, bool):
        raise ValueError("priority must be 'interactive', 'batch' or an integer")
    if isinstance(p, int):
        return "interactive" if p <= 0 else "batch"
    if isinstance(p, str) and p.strip().lower() in PRIORITY_CLASSES:
        return p.strip().lower()
    if isinstance(p, str) and p.strip().lstrip("-").isdigit():
        return "interactive" if int(p) <= 0 else "batch"
    raise ValueError(f"priority must be 'interactive', 'batch' or an integer, got {p!r}")


class QueueTimeout(Exception):
    pass


@dataclass
class Ticket:
    tenant: str
    priority: str
    cost: float
    choose: Callable[[list[Replica]], Replica | None]
    key: tuple = ()
    arrival_seq: int = 0
    dispatch_seq: int = -1
    dispatched_before: int = 0
    enqueued_at: float = 0.0
    queue_wait: float = 0.0
    future: asyncio.Future | None = None
    cancelled: bool = False
    replica: Replica | None = None
    meta: dict = field(default_factory=dict)

    def __lt__(self, other: "Ticket") -> bool:
        return self.key < other.key


class FairScheduler:
    """policy 'wfq' (fair between tenants, interactive before batch) or 'fifo' (arrival order; the baseline)."""

    def __init__(self, replicas: Callable[[], list[Replica]], max_inflight_per_replica: int = 4,
                 tenant_weights: dict[str, float] | None = None, policy: str = "wfq",
                 queue_timeout: float = 120.0, max_queued_per_tenant: int = 1000):
        if policy not in ("wfq", "fifo"):
            raise ValueError(f"unknown QoS policy {policy!r}: use 'wfq' or 'fifo'")
        if max_inflight_per_replica < 1:
            raise ValueError("max_inflight_per_replica must be >= 1")
        self.replicas = replicas
        self.limit = max_inflight_per_replica
        self.weights = dict(tenant_weights or {})
        self.policy = policy
        self.queue_timeout = queue_timeout
        self.max_queued_per_tenant = max_queued_per_tenant
        self.vtime = 0.0
        self.last_finish: dict[str, float] = {}
        self.queued: dict[str, int] = {}
        self._heap: list[Ticket] = []
        self._arrivals = itertools.count()
        self.dispatched = 0  # requests handed a slot so far

    def queue_len(self) -> int:
        return sum(self.queued.values())

    def _tag(self, t: Ticket) -> None:
        t.arrival_seq = next(self._arrivals)
        t.dispatched_before = self.dispatched  # with dispatch_seq: how many were served while this one waited
        if self.policy == "fifo":
            t.key = (0, t.arrival_seq)
            return
        start = max(self.vtime, self.last_finish.get(t.tenant, 0.0))
        finish = start + t.cost / self.weights.get(t.tenant, 1.0)
        self.last_finish[t.tenant] = finish
        t.meta["start_tag"] = start
        t.key = (PRIORITY_CLASSES[t.priority], finish, t.arrival_seq)

    async def acquire(self, t: Ticket) -> Replica:
        """Wait for this request's turn and a replica slot; returns the replica (slot held until release())."""
        if self.queued.get(t.tenant, 0) >= self.max_queued_per_tenant:
            raise QueueTimeout(f"tenant {t.tenant!r} has too many queued requests")
        t.future = asyncio.get_running_loop().create_future()
        t.enqueued_at = time.monotonic()
        self._tag(t)
        heapq.heappush(self._heap, t)
        self.queued[t.tenant] = self.queued.get(t.tenant, 0) + 1
        self.pump()
        try:
            return await asyncio.wait_for(asyncio.shield(t.future), self.queue_timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            if t.future.done() and not t.future.cancelled():
                self.release(t.future.result())  # won the race: hand the slot back
            else:
                t.cancelled = True
                t.future.cancel()
                self.queued[t.tenant] -= 1
            if isinstance(e, asyncio.TimeoutError):
                raise QueueTimeout(f"no replica slot within {self.queue_timeout:.0f}s") from None
            raise

    def pump(self) -> None:
        """Hand free slots to queued tickets in queue order. A ticket that cannot use any free replica (e.g. it
        needs a decode replica and only prefill ones are free) keeps its place but does not block the ones
        behind it: with P/D, a request holding a decode slot must be able to get its prefill slot."""
        blocked = []
        while self._heap:
            head = heapq.heappop(self._heap)
            if head.cancelled:
                continue
            free = [r for r in self.replicas() if r.healthy and r.inflight < self.limit]
            if not free:
                heapq.heappush(self._heap, head)
                break
            replica = head.choose(free)
            if replica is None:
                blocked.append(head)
                continue
            self.queued[head.tenant] -= 1
            replica.inflight += 1
            if self.policy == "wfq":
                self.vtime = max(self.vtime, head.meta["start_tag"])
            head.dispatch_seq = self.dispatched
            self.dispatched += 1
            head.queue_wait = time.monotonic() - head.enqueued_at
            head.replica = replica
            head.future.set_result(replica)
        for t in blocked:
            heapq.heappush(self._heap, t)

    def release(self, replica: Replica) -> None:
        replica.inflight = max(0, replica.inflight - 1)
        self.pump()
