"""Acknowledgements handed to Faust in offset order, per partition.

The processor releases a message once everything built from it is published, so the messages of one
partition are released out of order: two hosts share a partition, and one host's window closes while the
other's is still open. Faust commits the first run of consecutive acknowledged offsets, and checks that the
run starts at the partition's committed offset only when it knows that offset (it forgets it at a revoke, and
a seek that fails during a rebalance leaves it unknown) and only when the run starts more than one offset past
it (faust/transport/consumer.py, `Consumer._new_offset`: with 101 next and 102 acknowledged it commits 103).
A commit could so pass a message still held in an open window; after the next rebalance or restart its new
owner starts past it, and its events never reach a window. Held back here until every earlier message of its
partition is released, an acknowledgement always extends a run that starts at the first message read since
the assignment, which is where the committed offset points.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable


class PartitionAckOrder:
    def __init__(self):
        self._lock = threading.Lock()
        self._queues: dict[tuple[str, int], deque] = {}  # (topic, partition) -> [offset, released, ack], in order
        self.held = 0  # releases waiting for an earlier message of their partition (a gauge)

    def track(self, topic: str, partition: int, offset: int, ack: Callable[[], None]) -> Callable[[], None]:
        """Take a message in, in the order it was read; returns the release to call in place of ``ack``."""
        entry = [offset, False, ack]
        key = (topic, int(partition))
        with self._lock:
            queue = self._queues.get(key)
            if queue is None or (queue and queue[-1][0] >= offset):  # new here, or read again from an earlier
                if queue is not None:                                 # offset (a seek): a new run
                    self._drop(queue)
                queue = self._queues[key] = deque()
            queue.append(entry)

        def release() -> None:
            due = []
            with self._lock:
                if entry[1]:
                    return
                entry[1] = True
                if self._queues.get(key) is not queue:  # the partition was revoked since: never acknowledged
                    return
                self.held += 1
                while queue and queue[0][1]:
                    due.append(queue.popleft()[2])
                self.held -= len(due)
            for ack in due:  # outside the lock: Faust's ack takes its own
                ack()
        return release

    def forget(self, partitions) -> None:
        """The group took these (topic, partition)s away: their held releases are dropped, never acknowledged
        here (their new owner reads them again), and a later assignment starts a new run."""
        with self._lock:
            for topic, partition in partitions:
                queue = self._queues.pop((topic, int(partition)), None)
                if queue is not None:
                    self._drop(queue)

    def _drop(self, queue: deque) -> None:
        """A run given up (under the lock): its held releases leave the gauge; later ones find it gone."""
        self.held -= sum(1 for e in queue if e[1])
