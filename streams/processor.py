"""The stream worker's core, independent of Faust so it can be driven and tested directly.

For every message: decode and validate (failures go to the DLQ with the
reason), buffer the raw rows, fold the events into windows. On flush: store
the raw rows, close ripe windows, store their feature rows and publish them,
then acknowledge each message whose rows and windows are all stored. Only
acknowledged offsets are committed, so a crash replays instead of losing.

Duplicates: a batch id seen in this run is skipped whole; a batch id the
store already held when we started (a replay after a crash) is not inserted
again as raw rows, and windows the store already holds are not emitted again.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Callable

from fleetscope.schema import validate
from fleetscope.wire import Batch, WireError, decode
from fleetscope.streams.scoring import Scorer
from fleetscope.streams.sinks import DeadLetters, FeatureSink, RawSink
from fleetscope.streams.steps import JobSteps
from fleetscope.streams.windows import WindowAssembler

log = logging.getLogger(__name__)


@dataclass(eq=False)
class MessageRef:
    topic: str
    partition: int
    offset: int
    ack: Callable[[], None] = lambda: None
    pending: int = 0
    acked: bool = False

    def release(self) -> None:
        self.pending -= 1
        if self.pending <= 0 and not self.acked:
            self.acked = True
            self.ack()


@dataclass
class ProcessorStats:
    messages_in: int = 0
    events_in: int = 0
    dlq: int = 0
    duplicate_batches: int = 0
    windows_out: int = 0
    flushes: int = 0
    store_errors: int = 0
    last_window_end_ns: int = 0


class SeenBatches:
    """Batch ids handled in this run (bounded, oldest forgotten first)."""

    def __init__(self, capacity: int = 200_000):
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, batch_id: str) -> bool:
        """True if new."""
        if batch_id in self._ids:
            return False
        self._ids[batch_id] = None
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)
        return True


@dataclass
class FlushJob:
    """What one flush stores: taken on the event loop, written on any thread."""

    raw: list[tuple[Batch, MessageRef]]
    dead: list[tuple[MessageRef, bytes | None, str]]
    windows: list
    skipped: list[MessageRef]  # duplicates: nothing to store, acknowledged in order with the rest

    def refs(self) -> list[MessageRef]:
        return ([ref for _, ref in self.raw] + [ref for ref, _, _ in self.dead]
                + [ref for w in self.windows for ref in w.messages] + self.skipped)


class StreamProcessor:
    def __init__(self, cfg, store, producer=None, clock=time.monotonic,
                 flush_interval_s: float = 0.25, flush_rows: int = 200_000, scoring: bool = True):
        self.cfg = cfg
        self.raw = RawSink(store)
        self.features = FeatureSink(cfg, store, producer)
        self.dead = DeadLetters(cfg, store, producer)
        self.windows = WindowAssembler(cfg.window_s, cfg.allowed_lateness_s, cfg.idle_close_s,
                                       stored_marks=self.features.stored_mark, clock=clock)
        self.steps = JobSteps(cfg.step_hold_s, clock=clock)
        self.scorer = Scorer(cfg, store, producer) if scoring else None
        self.producer = producer
        self.seen = SeenBatches()
        self.stats = ProcessorStats()
        self.clock = clock
        self.flush_interval_s = flush_interval_s
        self.flush_rows = flush_rows
        self.raw_rows = 0
        self._raw: list[tuple[Batch, MessageRef]] = []
        self._dead: list[tuple[MessageRef, bytes | None, str]] = []
        self._skipped: list[MessageRef] = []
        self._retry: FlushJob | None = None
        self._last_flush = clock()
        self._pending_refs: list[MessageRef] = []

    def handle(self, value: bytes | None, headers, ref: MessageRef) -> None:
        """Take one message. Never raises on bad input."""
        self.stats.messages_in += 1
        ref.pending += 1  # released when this message's raw rows are stored (or it is dead-lettered)
        self._pending_refs.append(ref)
        try:
            batch = decode(value, headers)
            validate(batch)
        except WireError as exc:
            log.warning("dead-letter %s[%d]@%d: %s", ref.topic, ref.partition, ref.offset, exc)
            self._dead.append((ref, value, str(exc)))
            self.stats.dlq += 1
            return
        if not self.seen.add(batch.batch_id):
            self.stats.duplicate_batches += 1
            self._skipped.append(ref)
            return
        self.stats.events_in += batch.count
        self._raw.append((batch, ref))
        self.raw_rows += batch.count
        # each touched window holds the message until that window is stored
        ref.pending += len(self.windows.add(batch, ref))

    def due(self) -> bool:
        return (self.raw_rows >= self.flush_rows
                or self.clock() - self._last_flush >= self.flush_interval_s)

    def begin_flush(self, force: bool = False) -> FlushJob | None:
        """Take what is ready to store (event-loop thread). A failed job is retried first, whole."""
        self._last_flush = self.clock()
        if self._retry is not None:
            job, self._retry = self._retry, None
            return job
        ready = self.steps.admit(self.windows.pop_closed(force=force), force=force)
        job = FlushJob(self._raw, self._dead, ready, self._skipped)
        self._raw, self._dead, self._skipped, self.raw_rows = [], [], [], 0
        return job if (job.raw or job.dead or job.windows or job.skipped) else None

    def run_flush(self, job: FlushJob) -> bool:
        """Store and publish the job (any thread). Every insert carries a dedupe token,
        so running a job again after a partial failure stores nothing twice."""
        try:
            self.dead.write(job.dead)
            vectors = self.features.write(job.windows)
            if self.scorer is not None and job.windows:
                self.scorer.write(job.windows, vectors)
                if self.producer is not None and self.producer.flush(10.0):
                    raise RuntimeError("Kafka did not acknowledge the scores in time")
            # raw rows last: the largest insert must not delay the anomaly messages. Nothing is
            # acknowledged before all of it is stored, and a replay finds what is already there.
            self.raw.write([b for b, _ in job.raw])
            return True
        except Exception:
            self.stats.store_errors += 1
            log.exception("flush failed; its messages stay unacknowledged and the flush is retried")
            return False

    def finish_flush(self, job: FlushJob, ok: bool) -> None:
        """Acknowledge what the job stored (event-loop thread)."""
        if not ok:
            self._retry = job
            return
        self.stats.flushes += 1
        if job.windows:
            self.stats.windows_out += len(job.windows)
            self.stats.last_window_end_ns = max(w.end_ns for w in job.windows)
        for ref in job.refs():
            ref.release()
        self._pending_refs = [r for r in self._pending_refs if not r.acked]

    def flush(self, force: bool = False) -> None:
        """begin, run and finish in the caller's thread."""
        job = self.begin_flush(force)
        if job is not None:
            self.finish_flush(job, self.run_flush(job))

    def snapshot(self) -> dict:
        s = asdict(self.stats)
        ws = self.windows.stats
        if self.scorer is not None:
            s.update({f"model_{k}": v for k, v in asdict(self.scorer.stats).items()})
        s.update(open_windows=len(self.windows.open), waiting_windows=self.steps.waiting_windows(),
                 late_events=ws.late_events,
                 replayed_events=ws.replayed_events, unacked_messages=len(self._pending_refs))
        return s
