"""Where a worker reads its jobs' state back (see model_state.py).

- ModelStateTopic: the `<prefix>.model-state` topic itself, read to its end
  before the first answer after each `invalidate()`, so a worker that just
  took a partition over sees everything the previous owner published before
  letting it go; each message is folded into the job's state held so far
  (JobState.folded), so a stale state written late cannot undo a newer one. The processor invalidates whenever a message comes from an
  input partition it does not hold yet (a start, an assignment, a partition
  back after a revoke). Between those, only this worker publishes its jobs'
  states, so the topic holds nothing new for them: reading it to its end on
  every new job (its end is one watermark request per partition, ~10 ms
  each) cost 5.2 s of a flush when 126 jobs arrived at once.
- StoreStates: the `model_state` table, for a processor run in-process with
  its sink (tests, benchmarks, tools): the sink mirrors the topic there.
"""
from __future__ import annotations

import logging
import time
from typing import Protocol

from fleetscope.streams.model_state import JobState
from fleetscope.topic_reader import drain

log = logging.getLogger(__name__)
DRAIN_SETTLE_S = 0.1  # one empty poll this long ends a catch-up (only after partitions arrive)


class JobStates(Protocol):
    """Where the processor reads its jobs' states back from."""

    def latest(self, tenant: str, job: str) -> JobState | None:
        """The job's newest state; raises if it cannot be read now (the caller asks again later)."""

    def forget(self, tenant: str, job: str) -> None:
        """The job left this worker (its partition was revoked)."""

    def invalidate(self) -> None:
        """Input partitions arrived: others may have published states this worker now needs."""


class ModelStateTopic:
    def __init__(self, consumer_conf: dict, topic: str, timeout_s: float = 10.0):
        from confluent_kafka import Consumer
        self.topic = topic
        self.timeout_s = timeout_s
        self._consumer = Consumer({**consumer_conf, "enable.auto.commit": False, "auto.offset.reset": "earliest",
                                   "fetch.wait.max.ms": 10})
        self._latest: dict[tuple[str, str], JobState] = {}
        self._assigned: list = []
        self.unreadable = 0
        self.catch_ups = 0                   # reads to the end done
        self._wanted, self._read = 1, 0      # invalidations asked for / covered by a finished read

    def latest(self, tenant: str, job: str) -> JobState | None:
        if self._read < self._wanted:
            self.catch_up()
        return self._latest.get((tenant, job))

    def invalidate(self) -> None:
        """Others may have published states this worker now needs: read to the end before the next answer.
        (A counter, not a flag: an invalidation during a read in flight on the flush thread is not lost.)"""
        self._wanted += 1

    def forget(self, tenant: str, job: str) -> None:
        self._latest.pop((tenant, job), None)

    def catch_up(self) -> None:
        """Read every partition up to its current end; raises RuntimeError if Kafka does not answer in time."""
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition
        deadline = time.monotonic() + self.timeout_s
        wanted = self._wanted
        if not self._assigned:
            meta = self._consumer.list_topics(self.topic, timeout=self.timeout_s)
            parts = meta.topics[self.topic].partitions if self.topic in meta.topics else {}
            if not parts:
                raise RuntimeError(f"topic {self.topic} does not exist")
            self._assigned = [TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in sorted(parts)]
            self._consumer.assign(self._assigned)
        ends = {tp.partition: self._consumer.get_watermark_offsets(tp, timeout=self.timeout_s)[1]
                for tp in self._assigned}
        done = {p for p, end in ends.items() if end == 0 or self._position(p) >= end}
        while len(done) < len(ends):
            if time.monotonic() > deadline:
                raise RuntimeError(f"reading {self.topic} to its end took over {self.timeout_s} s")
            for msg in self._consumer.consume(1000, 0.1):
                if msg.error() is not None:
                    continue
                self._take(msg)
                if msg.offset() + 1 >= ends.get(msg.partition(), 0):
                    done.add(msg.partition())
        # tansu reports a partition's end as its last record batch's first offset + 1 (topic_reader.py): the
        # rest of that batch, the newest states, may come after the reported end
        drain(self._consumer, self._take, DRAIN_SETTLE_S, deadline)
        self._read = wanted
        self.catch_ups += 1

    def _take(self, msg) -> None:
        if msg.value() is None:
            return
        try:
            state = JobState.decode(msg.value())
            held = self._latest.get((state.tenant, state.job))
            self._latest[(state.tenant, state.job)] = state if held is None else held.folded(state)
        except ValueError as exc:
            self.unreadable += 1
            log.warning("skipped an unreadable %s message at %d/%d: %s", self.topic,
                        msg.partition(), msg.offset(), exc)

    def _position(self, partition: int) -> int:
        from confluent_kafka import TopicPartition
        pos = self._consumer.position([TopicPartition(self.topic, partition)])[0].offset
        return pos if pos >= 0 else 0

    def close(self) -> None:
        self._consumer.close()


class StoreStates:
    def __init__(self, store):
        self.store = store

    def latest(self, tenant: str, job: str) -> JobState | None:
        res = self.store.query("SELECT state, marks FROM model_state FINAL WHERE tenant = {t:String} AND job = {j:String} "
                               "ORDER BY saved_at DESC LIMIT 1", {"t": tenant, "j": job})
        if not res.rows:
            return None
        model, marks = res.rows[0]
        try:
            parsed = JobState.decode(marks.encode()) if marks else JobState(tenant, job)
        except ValueError:
            parsed = JobState(tenant, job)
        parsed.tenant, parsed.job, parsed.model_b64 = tenant, job, model or None
        return parsed

    def forget(self, tenant: str, job: str) -> None:
        pass

    def invalidate(self) -> None:
        pass  # every answer is a query of the table
