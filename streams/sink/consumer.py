"""`fleetscope sink`'s loop: consume raw and derived topics, store, then commit.

Any number of sinks share one consumer group. Each poll's records become
inserts (writer.py); the offsets are committed only once every insert of the
poll is done, so a crash replays into the dedupe instead of losing.
Backpressure: while the store is down, the sink pauses its partitions and
retries the same inserts every STORE_RETRY_S, holding one poll in memory at
most (`sink_poll_records`); errors are logged once per period with a count.
"""
from __future__ import annotations

import logging
import threading
import time

from fleetscope.topics import RAW_SOURCES
from fleetscope.streams.outage_log import OutageLog
from fleetscope.streams.sink.tables import Record
from fleetscope.streams.sink.writer import TopicWriter, run_all
from fleetscope.streams.store_writes import StoreUnavailable

log = logging.getLogger(__name__)
STORE_RETRY_S = 1.0
POLL_RECORDS = 5000


def sink_topics(cfg) -> list[str]:
    return ([cfg.raw_topic(s) for s in RAW_SOURCES]
            + [cfg.topic(k) for k in ("features", "scores", "anomalies", "diagnoses", "dlq", "model-state")])


class Sink:
    def __init__(self, cfg, store, consumer, producer=None, clock=time.monotonic, poll_records: int = POLL_RECORDS):
        self.cfg = cfg
        self.store = store
        self.consumer = consumer
        self.producer = producer
        self.writer = TopicWriter(cfg, store)
        self.clock = clock
        self.poll_records = poll_records
        self.outage = OutageLog(log, "store unavailable (sink paused)", cfg.store_error_log_s, clock)
        self.paused = False
        self.commits = 0
        self._pending = None  # (inserts, records, offsets) of the poll being stored
        self._last_try = 0.0

    def on_assign(self, consumer, partitions) -> None:
        self.writer.forget_replays()

    def step(self, timeout_s: float = 0.2) -> None:
        if self._pending is None:
            msgs = self.consumer.consume(self.poll_records, timeout_s)
            records, offsets = [], {}
            for m in msgs:
                if m.error() is not None:
                    continue
                ts = m.timestamp()
                records.append(Record(m.topic(), m.partition(), m.offset(), int(ts[1]) if ts and ts[0] else 0,
                                      m.key(), m.value(), m.headers() or []))
                offsets[(m.topic(), m.partition())] = m.offset() + 1
            if not records:
                return
            try:
                inserts = self.writer.inserts(records)
            except StoreUnavailable as exc:
                self._pause(exc)
                self._pending = (None, records, offsets)
                return
            self._pending = (inserts, records, offsets)
        elif self.paused and self.clock() - self._last_try < STORE_RETRY_S:
            time.sleep(min(timeout_s, 0.1))
            self.consumer.poll(0)  # keeps the group membership alive while paused
            return
        inserts, records, offsets = self._pending
        try:
            if inserts is None:
                inserts = self.writer.inserts(records)
                self._pending = (inserts, records, offsets)
            run_all(inserts, self.store)
            dead = self.writer.dead_letter_insert()
            if dead is not None:
                insert, recs = dead
                self._pending = ([insert], records, offsets)
                run_all([insert], self.store)
                self._publish_dead(recs)
        except StoreUnavailable as exc:
            self._pause(exc)
            return
        self._commit(offsets)
        self._pending = None
        if self.paused:
            self.consumer.resume(self.consumer.assignment())
            self.paused = False
        self.outage.recovered()

    def _pause(self, exc) -> None:
        self.outage.failed(exc)
        self._last_try = self.clock()
        if not self.paused:
            self.consumer.pause(self.consumer.assignment())
            self.paused = True

    def _publish_dead(self, recs: list[Record]) -> None:
        if self.producer is None:
            return
        for r in recs:
            self.producer.produce(self.cfg.topic("dlq"), value=r.value, key=r.key, headers=r.headers)
        if self.producer.flush(10.0):
            log.warning("Kafka did not take %d dead letters within 10 s; they are in the dlq table", len(recs))

    def _commit(self, offsets: dict) -> None:
        from confluent_kafka import TopicPartition
        self.consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()], asynchronous=False)
        self.commits += 1

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.step()
            except Exception:  # a bug must not end the sink silently: log it, keep the poll, try again
                log.exception("sink step failed; retrying")
                time.sleep(STORE_RETRY_S)

    def snapshot(self) -> dict:
        from dataclasses import asdict
        return {**{f"sink_{k}": v for k, v in asdict(self.writer.stats).items()}, "sink_paused": self.paused,
                "sink_commits": self.commits,
                "sink_store_down_s": (self.clock() - self.outage.down_since if self.outage.down_since is not None
                                      else 0.0)}
