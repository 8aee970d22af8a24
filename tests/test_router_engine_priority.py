"""The engine's scheduler honours the per-request priority the router forwards (lower first, FIFO within a
class), so batch work queued inside a replica does not delay interactive requests."""
import pytest

from kestrel.engine.block_manager import BlockManager
from kestrel.engine.sampling_params import SamplingParams
from kestrel.engine.scheduler import Scheduler
from kestrel.engine.sequence import Sequence


def test_admission_order_follows_priority_then_arrival():
    sched = Scheduler(BlockManager(num_blocks=64, block_size=16), max_num_seqs=1, max_num_batched_tokens=512)
    arrivals = [("b1", 1), ("b2", 1), ("i1", 0), ("b3", 1), ("i2", 0), ("u1", -1)]
    seqs = {rid: Sequence(rid, [1, 2, 3], SamplingParams(priority=p)) for rid, p in arrivals}
    for rid, _ in arrivals:
        sched.add(seqs[rid])
    admitted = []
    while sched.has_unfinished():
        batch = sched.schedule()
        assert len(batch.seqs) == 1  # one slot: admission order is fully visible
        admitted.append(batch.seqs[0].request_id)
        sched.finish(batch.seqs[0], "stop")
    # reference order written out from the rule: by priority value, then arrival
    assert admitted == ["u1", "i1", "i2", "b1", "b2", "b3"]


def test_priority_must_be_integer():
    for bad in ("batch", 1.5, True):
        with pytest.raises(ValueError, match="priority"):
            SamplingParams(priority=bad)
