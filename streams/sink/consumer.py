"""`fleetscope sink`'s loop: consume raw and derived topics, store, then commit.

Any number of sinks share one consumer group. Each poll's records become
inserts (writer.py); the offsets are committed only once every insert of the
poll is done, so a crash replays into the dedupe instead of losing.
A poll's offsets are written ahead (poll_plan.py): a sink killed between
storing and committing replays exactly that poll first, grouped the same,
so its inserts carry the same dedupe tokens and the store drops the copy.
Backpressure: while the store is down, the sink pauses its partitions and
retries the same inserts every STORE_RETRY_S, holding one poll in memory at
most; errors are logged once per period with a count.
A poll is bounded by records (POLL_RECORDS) and by rows (`sink_max_rows_per_insert`,
counted from each record's fs-count header): records taken from Kafka beyond
the rows are carried, in order, to the next poll, and nothing more is fetched
while the carried ones fill one. The cut falls in (topic, partition, offset)
order, so each partition's part of a poll is a run of consecutive offsets: its
plan's ranges name exactly its records, and a replay regroups nothing.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from fleetscope.batch import H_COUNT
from fleetscope.topics import RAW_SOURCES
from fleetscope.streams.outage_log import OutageLog
from fleetscope.streams.sink.poll_plan import PollPlan
from fleetscope.streams.sink.tables import Record
from fleetscope.streams.sink.writer import TopicWriter, run_all
from fleetscope.streams.store_writes import StoreUnavailable

log = logging.getLogger(__name__)
STORE_RETRY_S = 1.0
POLL_RECORDS = 5000
REPLAY_WAIT_S = 30.0  # how long a restarted sink waits for its planned records before it goes on without
PLAN_FILE = "sink-poll-plan.json"
BYTES_PER_UNCOUNTED_ROW = 4  # a record without a row count counts one row per this many bytes (Arrow+zstd: 6-10)


def sink_topics(cfg) -> list[str]:
    return ([cfg.raw_topic(s) for s in RAW_SOURCES]
            + [cfg.topic(k) for k in ("features", "scores", "anomalies", "diagnoses", "dlq", "model-state", "traces")])


class Sink:
    def __init__(self, cfg, store, consumer, producer=None, clock=time.monotonic, poll_records: int = POLL_RECORDS,
                 plan_path: Path | None = None, max_rows: int | None = None):
        self.cfg = cfg
        self.store = store
        self.consumer = consumer
        self.producer = producer
        self.writer = TopicWriter(cfg, store)
        self.clock = clock
        self.poll_records = poll_records
        self.max_rows = max_rows if max_rows is not None else cfg.sink_max_rows_per_insert
        self.outage = OutageLog(log, "store unavailable (sink paused)", cfg.store_error_log_s, clock)
        self.paused = False
        self.commits = 0
        self._pending = None  # (inserts, records, offsets) of the poll being stored
        self._last_try = 0.0
        self.plan = PollPlan(plan_path if plan_path is not None else
                             (Path(cfg.data_dir) / PLAN_FILE if cfg.data_dir else None))
        self._replay = self.plan.load()  # the poll a killed sink stored but did not commit, if any
        self._replay_records: list[Record] = []
        self._replay_deadline: float | None = None
        self._carry: list[Record] = []  # taken from Kafka beyond the plan or a poll's rows: the next poll's
        self.replayed_polls = 0

    def on_assign(self, consumer, partitions) -> None:
        self.writer.forget_replays()
        # Kafka fetches again from the committed offsets after a rebalance: records carried from before it
        # would be stored twice, or by this sink for a partition another now owns.
        self._carry = []

    def step(self, timeout_s: float = 0.2) -> None:
        if self._pending is None:
            records = self._take(timeout_s)
            if not records:
                return
            # the same records in the same order make the same inserts and tokens, however Kafka interleaved them
            records.sort(key=lambda r: (r.topic, r.partition, r.offset))
            offsets = {}
            for r in records:
                offsets[(r.topic, r.partition)] = max(offsets.get((r.topic, r.partition), 0), r.offset + 1)
            self.plan.write(records)
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
        try:
            self._commit(offsets)
        except Exception as exc:  # the group moved on (a rebalance, or this sink frozen past its session)
            log.warning("committing the stored poll failed (%s); it will be replayed as planned and the store "
                        "drops the copy", exc)
            self._pending, self._replay, self._replay_deadline = None, self.plan.load(), None
            return
        self.plan.clear()
        self._pending = None
        if self.paused:
            self.consumer.resume(self.consumer.assignment())
            self.paused = False
        self.outage.recovered()

    def _take(self, timeout_s: float) -> list[Record]:
        """The next poll: after a restart, the planned records alone; then the carried and new ones."""
        fresh = self._fetch(timeout_s)
        if not self._replay:
            return self._bounded(self._carry + fresh)
        if self._replay_deadline is None:
            self._replay_deadline = self.clock() + REPLAY_WAIT_S
            self._drop_committed_ranges()
        for r in fresh:
            span = self._replay.get((r.topic, r.partition))
            (self._replay_records if span and span[0] <= r.offset <= span[1] else self._carry).append(r)
        seen = {}
        for r in self._replay_records + self._carry:
            seen[(r.topic, r.partition)] = max(seen.get((r.topic, r.partition), -1), r.offset)
        complete = all(seen.get(tp, -1) >= last for tp, (_, last) in self._replay.items())
        if not complete and self.clock() < self._replay_deadline:
            return []
        if not complete:
            log.warning("replaying the interrupted poll without all its records after %.0f s (a partition moved "
                        "or its records are gone); rows stored before the kill may show twice until a merge",
                        REPLAY_WAIT_S)
        records, self._replay_records, self._replay = self._replay_records, [], {}
        self.replayed_polls += 1
        return records

    def _fetch(self, timeout_s: float) -> list[Record]:
        """New records from Kafka, unless those carried over already fill a poll."""
        room = self.poll_records
        if not self._replay:  # a replay takes all it can: its planned records may lie behind others
            room -= len(self._carry)
            if room <= 0 or sum(map(record_rows, self._carry)) >= self.max_rows:
                return []
        return [self._record(m) for m in self.consumer.consume(room, timeout_s) if m.error() is None]

    def _bounded(self, records: list[Record]) -> list[Record]:
        """The first records, in (topic, partition, offset) order, up to `max_rows` rows (at least one
        record); the rest are carried to the next poll."""
        records.sort(key=lambda r: (r.topic, r.partition, r.offset))
        rows, cut = 0, len(records)
        for i, r in enumerate(records):
            rows += record_rows(r)
            if rows > self.max_rows and i > 0:
                cut = i
                break
        records, self._carry = records[:cut], records[cut:]
        return records

    def _drop_committed_ranges(self) -> None:
        """Planned partitions whose commit went through (the kill came after it) are not replayed."""
        from confluent_kafka import TopicPartition
        try:
            committed = self.consumer.committed([TopicPartition(t, p) for t, p in self._replay], timeout=5.0)
        except Exception:  # no answer: wait for the planned records (bounded by REPLAY_WAIT_S)
            return
        for tp in committed:
            span = self._replay.get((tp.topic, tp.partition))
            if span is not None and tp.offset > span[1]:
                del self._replay[(tp.topic, tp.partition)]

    @staticmethod
    def _record(m) -> Record:
        ts = m.timestamp()
        return Record(m.topic(), m.partition(), m.offset(), int(ts[1]) if ts and ts[0] else 0,
                      m.key(), m.value(), m.headers() or [])

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
                "sink_commits": self.commits, "sink_replayed_polls": self.replayed_polls,
                "sink_store_down_s": (self.clock() - self.outage.down_since if self.outage.down_since is not None
                                      else 0.0)}


def record_rows(record: Record) -> int:
    """The rows a record will insert, for bounding a poll: its fs-count header (the decoder refuses a
    record whose header disagrees with its payload), else one row per BYTES_PER_UNCOUNTED_ROW bytes."""
    count = record.header(H_COUNT)
    if count is not None and count.isascii() and count.isdigit() and len(count) <= 12:
        return max(int(count), 1)
    return max(len(record.value or b"") // BYTES_PER_UNCOUNTED_ROW, 1)
