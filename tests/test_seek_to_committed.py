"""After a rebalance, every partition this worker still holds is seeked back to its committed offset, even when
one before it was revoked meanwhile (streams/faust_transport.py).

Faust drops the records it fetched while its flow was paused and seeks back to the committed offsets to fetch
them again; aiokafka's seek_to_committed() raised at the first partition revoked meanwhile and left the rest
unseeked, so the dropped records of a partition the worker kept were never read (the chaos suite's
worker-joins-and-leaves case runs this with real Faust workers and a real broker). The consumer here is a
stand-in: a revoke landing between two partitions of the walk cannot be timed on a real one.
"""
import asyncio

from aiokafka.errors import IllegalStateError
from aiokafka.structs import TopicPartition

from fleetscope.streams.faust_transport import seek_each_to_committed


class RevokedMidWalk:
    """Holds raw/0 and raw/1; raw/0 was revoked after the walk began, so asking for it raises."""

    def __init__(self, committed):
        self._committed = committed
        self.seeks = {}

    def assignment(self):
        return set(self._committed)

    async def committed(self, tp):
        if tp.partition == 0:
            raise IllegalStateError(f"No current assignment for partition {tp}")
        return self._committed[tp]

    def seek(self, tp, offset):
        self.seeks[tp] = offset


def test_a_partition_revoked_mid_walk_does_not_stop_the_others_being_seeked():
    p0, p1, p2 = (TopicPartition("raw", p) for p in range(3))
    consumer = RevokedMidWalk({p0: 40, p1: 17, p2: None})
    offsets = asyncio.run(seek_each_to_committed(consumer))
    assert consumer.seeks == {p1: 17}  # raw/1 is fetched again from 17; raw/2 has no commit: left as aiokafka does
    assert offsets == {p1: 17, p2: None}  # raw/0 is its new owner's
