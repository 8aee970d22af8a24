"""The fair queue on its own (no processes): dispatch order under a flooding tenant, tenant weights, priority
classes, and request tagging from headers. Bounds are in requests served, never in seconds."""
import asyncio

import pytest

from kestrel.router.qos import FairScheduler, QueueTimeout, Ticket, priority_of, tenant_of
from kestrel.router.replica import Replica


def _first(free):
    return free[0]


async def _run(policy, arrivals, slots=1, weights=None):
    """arrivals: list of (tenant, priority) queued in this order while every slot is busy; then slots free one at
    a time. Returns the tenants in dispatch order."""
    rep = Replica("http://r0")
    sched = FairScheduler(lambda: [rep], max_inflight_per_replica=slots, tenant_weights=weights, policy=policy)
    blockers = [asyncio.create_task(sched.acquire(Ticket("warm", "interactive", 1.0, _first))) for _ in range(slots)]
    await asyncio.gather(*blockers)
    order = []

    async def one(tenant, prio):
        await sched.acquire(Ticket(tenant, prio, 1.0, _first))
        order.append(tenant)

    tasks = []
    for tenant, prio in arrivals:
        tasks.append(asyncio.create_task(one(tenant, prio)))
        await asyncio.sleep(0)  # enqueue in this order
    for _ in range(len(arrivals) + slots):
        sched.release(rep)
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return order


def test_flooding_tenant_does_not_starve_other():
    flood = [("A", "interactive")] * 40 + [("B", "interactive")] * 3
    wfq = asyncio.run(_run("wfq", flood))
    # B arrived behind 40 of A's requests; with fair queueing each B request is served after at most one more A
    b_positions = [i for i, t in enumerate(wfq) if t == "B"]
    assert b_positions == [1, 3, 5], wfq[:8]
    # the FIFO baseline (same scheduler, policy off) makes B wait behind the whole flood: the test can fail
    fifo = asyncio.run(_run("fifo", flood))
    assert [i for i, t in enumerate(fifo) if t == "B"] == [40, 41, 42]


def test_tenant_weights_share_slots_proportionally():
    arrivals = [("A", "interactive")] * 30 + [("B", "interactive")] * 30
    order = asyncio.run(_run("wfq", arrivals, weights={"A": 3.0, "B": 1.0}))
    first = order[:20]
    assert first.count("A") == 15 and first.count("B") == 5


def test_interactive_before_batch():
    arrivals = [("A", "batch")] * 10 + [("B", "interactive")] * 2
    order = asyncio.run(_run("wfq", arrivals, slots=2))
    assert order[:2] == ["B", "B"]


def test_queue_timeout_and_cancel_free_their_place():
    async def main():
        rep = Replica("http://r0")
        sched = FairScheduler(lambda: [rep], max_inflight_per_replica=1, queue_timeout=0.05)
        await sched.acquire(Ticket("A", "interactive", 1.0, _first))
        with pytest.raises(QueueTimeout):
            await sched.acquire(Ticket("B", "interactive", 1.0, _first))
        assert sched.queue_len() == 0
        sched.release(rep)
        assert rep.inflight == 0
        # a down replica gives no slots
        rep.healthy = False
        with pytest.raises(QueueTimeout):
            await sched.acquire(Ticket("B", "interactive", 1.0, _first))
    asyncio.run(main())


def test_tenant_and_priority_from_request():
    assert tenant_of({"x-tenant": "acme"}, {}) == "acme"
    assert tenant_of({"authorization": "Bearer k1"}, {"k1": "team-1"}) == "team-1"
    anon = tenant_of({"authorization": "Bearer secret"}, {})
    assert anon.startswith("key-") and "secret" not in anon
    assert tenant_of({}, {}) == "default"
    assert priority_of({}, {}) == "interactive"
    assert priority_of({"x-priority": "batch"}, {}) == "batch"
    assert priority_of({}, {"priority": 5}) == "batch"
    assert priority_of({}, {"priority": 0}) == "interactive"
    for bad in ("urgent", [1], True):
        with pytest.raises(ValueError):
            priority_of({}, {"priority": bad})


def test_ticket_that_cannot_be_placed_does_not_block_others():
    """P/D: a request holding the only decode slot queues for a prefill slot behind another decode request;
    the prefill ticket must still be served (else both wait forever)."""
    async def main():
        dec, pre = Replica("http://d", role="decode"), Replica("http://p", role="prefill")
        sched = FairScheduler(lambda: [dec, pre], max_inflight_per_replica=1)

        def role(name):
            return lambda free: next((r for r in free if r.role == name), None)
        assert await sched.acquire(Ticket("A", "interactive", 1.0, role("decode"))) is dec
        waiting_decode = asyncio.create_task(sched.acquire(Ticket("B", "interactive", 1.0, role("decode"))))
        await asyncio.sleep(0)
        got = await asyncio.wait_for(sched.acquire(Ticket("A", "interactive", 1.0, role("prefill"))), 5)
        assert got is pre and not waiting_decode.done()
        sched.release(dec)
        assert await asyncio.wait_for(waiting_decode, 5) is dec
    asyncio.run(main())
