"""The stream worker's core, independent of Faust so it can be driven and tested directly.

For every message: decode, validate and admit it (see admission.py), buffer
its raw rows, fold its events into windows. Any failure on that way sends
the message to the DLQ with the reason; `handle` never raises, so nothing is
committed past silently.

A flush job then goes through three steps, each done once and retried on its own:
1. compute: close ripe windows, build their feature rows, score them;
2. publish: features, scores, anomalies, diagnoses and dead letters to Kafka;
3. store: dead letters, features, scores, anomalies, diagnoses, model
   checkpoints and raw rows, each insert isolating what the store refuses
   (store_writes.py).
A message is acknowledged once every job holding it is stored, and only
acknowledged offsets are committed, so a crash replays instead of losing.
While the store is down, jobs wait (in order) after step 2 and new ones are
still computed and published; past `max_unstored_rows` the consumer waits.

Duplicates: a batch id seen in this run is skipped whole; a batch id the
store already held when we started (a replay after a crash) is not inserted
again as raw rows, and windows the store already holds are not emitted again.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Callable

from fleetscope.schema import NODE_TENANT, validate
from fleetscope.wire import Batch, WireError, decode
from fleetscope.streams.admission import UNCHECKED_KEY, AdmissionError, TimeBounds, check_key, check_strings
from fleetscope.streams.outage_log import OutageLog
from fleetscope.streams.outbox import Outbox
from fleetscope.streams.scoring import Scorer
from fleetscope.streams.sinks import DeadLetters, FeatureSink, RawSink
from fleetscope.streams.steps import JobSteps
from fleetscope.streams.store_writes import Insert, StoreUnavailable, row_insert
from fleetscope.streams.windows import WindowAssembler

log = logging.getLogger(__name__)

STORE_RETRY_S = 1.0  # a waiting job's inserts are tried again this often
EVICT_CHECK_S = 10.0  # how often idle keys and models are looked for


@dataclass(eq=False)
class MessageRef:
    topic: str
    partition: int
    offset: int
    ack: Callable[[], None] = lambda: None
    timestamp_ms: int = 0  # the broker's timestamp: with the offset, it names the message across broker runs
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
    publish_errors: int = 0
    store_rejected: int = 0  # batches or rows the store refused, sent to the DLQ
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


DeadLetter = tuple[MessageRef, "bytes | None", str]


@dataclass(eq=False)
class FlushJob:
    """One flush: taken on the event loop, advanced on the flush thread, acknowledged on the loop."""

    raw: list[tuple[Batch, MessageRef, bytes | None]]
    dead: list[DeadLetter]
    windows: list
    skipped: list[MessageRef]  # duplicates and replays: nothing to store, acknowledged in order with the rest
    earlier: list["FlushJob"] = field(default_factory=list)  # jobs still waiting for the store, oldest first
    computed: bool = False
    published: bool = False
    raw_pending: bool = True  # raw inserts are made at the first store try (they check for replays there)
    inserts: list[Insert] = field(default_factory=list)
    messages: list = field(default_factory=list)
    rejected: list[DeadLetter] = field(default_factory=list)  # refused by the store: dead letters to add

    @property
    def stored(self) -> bool:
        return (self.computed and self.published and not self.raw_pending and not self.rejected
                and all(i.done for i in self.inserts))

    def refs(self) -> list[MessageRef]:
        return ([ref for _, ref, _ in self.raw] + [ref for ref, _, _ in self.dead]
                + [ref for w in self.windows for ref in w.messages] + self.skipped)

    def unstored_rows(self) -> int:
        return sum(b.count for b, _, _ in self.raw)


class StreamProcessor:
    def __init__(self, cfg, store, producer=None, clock=time.monotonic,
                 flush_interval_s: float = 0.25, flush_rows: int = 200_000, scoring: bool = True,
                 wall_clock_ns=time.time_ns, max_unstored_rows: int | None = None):
        self.cfg = cfg
        self.store = store
        self.producer = producer
        self.outbox = Outbox(store)
        collected = self.outbox if producer is not None else None
        self.raw = RawSink(store)
        self.features = FeatureSink(cfg, self.outbox, collected)
        self.dead = DeadLetters(cfg, store, collected)
        self.windows = WindowAssembler(cfg.window_s, cfg.allowed_lateness_s, cfg.idle_close_s,
                                       stored_marks=self.features.stored_mark, clock=clock)
        self.steps = JobSteps(cfg.step_hold_s, clock=clock)
        self.scorer = Scorer(cfg, self.outbox, collected) if scoring else None
        self.time_bounds = TimeBounds(cfg.ttl_days, cfg.max_future_skew_s, wall_clock_ns)
        self.seen = SeenBatches()
        self.stats = ProcessorStats()
        self.clock = clock
        self.flush_interval_s = flush_interval_s
        self.flush_rows = flush_rows
        self.max_unstored_rows = max_unstored_rows or 5 * flush_rows
        self.raw_rows = 0
        self._raw: list[tuple[Batch, MessageRef, bytes | None]] = []
        self._dead: list[DeadLetter] = []
        self._skipped: list[MessageRef] = []
        self._waiting: list[FlushJob] = []  # computed and published, not yet stored
        self._last_flush = clock()
        self._last_store_try = -float("inf")
        self._pending_refs: list[MessageRef] = []
        self._last_evict_check = clock()
        self._job_scored_at: dict[tuple[str, str], float] = {}  # flush thread: when a job's model last scored
        self.evicted_models = 0
        self.store_outage = OutageLog(log, "store unavailable", cfg.store_error_log_s, clock)
        self.kafka_outage = OutageLog(log, "publishing to Kafka failed", cfg.store_error_log_s, clock)
        self.handling_errors = OutageLog(log, "a message failed after decoding (sent to the DLQ)",
                                         cfg.store_error_log_s, clock)

    # ---- messages (event-loop thread) ------------------------------------------
    def handle(self, value: bytes | None, headers, ref: MessageRef, key=UNCHECKED_KEY) -> None:
        """Take one message. Never raises: whatever goes wrong sends it to the DLQ with the reason.

        `key` is the Kafka key; callers that do not read Kafka (tests, benchmarks) leave it out."""
        self.stats.messages_in += 1
        ref.pending += 1  # released when this message's raw rows are stored (or it is dead-lettered)
        self._pending_refs.append(ref)
        try:
            batch = decode(value, headers)
            validate(batch)
            check_strings(batch)
            self.time_bounds.check(batch.columns["ts_ns"])
            check_key(key, batch)
        except (WireError, AdmissionError) as exc:
            self._dead_letter(ref, value, str(exc))
            return
        except Exception as exc:  # the decoder let something else escape: still this message's fault
            self._dead_letter(ref, value, f"decoding failed: {type(exc).__name__}: {exc}")
            return
        if not self.seen.add(batch.batch_id):
            self.stats.duplicate_batches += 1
            self._skipped.append(ref)
            return
        try:
            touched = self.windows.add(batch, ref)
        except Exception as exc:
            self.handling_errors.failed(exc)
            self._dead_letter(ref, value, f"windowing failed: {type(exc).__name__}: {exc}")
            return
        self.stats.events_in += batch.count
        self._raw.append((batch, ref, value))
        self.raw_rows += batch.count
        # each touched window holds the message until that window is stored
        ref.pending += len(touched)

    def _dead_letter(self, ref: MessageRef, value, reason: str) -> None:
        log.warning("dead-letter %s[%d]@%d: %s", ref.topic, ref.partition, ref.offset, reason[:300])
        self._dead.append((ref, value, reason))
        self.stats.dlq += 1

    # ---- flushes ------------------------------------------------------------------
    def due(self) -> bool:
        return (self.raw_rows >= self.flush_rows
                or self.clock() - self._last_flush >= self.flush_interval_s)

    def backlogged(self) -> bool:
        """Too much waits for the store: the consumer should wait too (backpressure)."""
        return self.raw_rows + sum(j.unstored_rows() for j in self._waiting) >= self.max_unstored_rows

    def begin_flush(self, force: bool = False) -> FlushJob | None:
        """Take what is ready (event-loop thread). Jobs waiting for the store ride along, oldest first."""
        now = self.clock()
        self._last_flush = now
        if now - self._last_evict_check >= EVICT_CHECK_S:
            self._last_evict_check = now
            self._evict_idle_keys()
        ready = self.steps.admit(self.windows.pop_closed(force=force), force=force)
        skipped = self._skipped + [ref for w in self.windows.take_replayed() for ref in w.messages]
        job = FlushJob(self._raw, self._dead, ready, skipped)
        self._raw, self._dead, self._skipped, self.raw_rows = [], [], [], 0
        fresh = bool(job.raw or job.dead or job.windows or job.skipped)
        retry_due = bool(self._waiting) and (force or now - self._last_store_try >= STORE_RETRY_S)
        if not fresh and not retry_due:
            return None
        job.earlier = list(self._waiting)
        self._waiting = []
        return job

    def run_flush(self, job: FlushJob) -> bool:
        """Advance the waiting jobs and this one as far as they go (any thread). True if all are stored.

        Jobs are computed in order, and stop at the first that cannot be (its model could not be
        restored): a job's windows must reach its model in window order."""
        jobs = job.earlier + [job]
        # while the store is down, try it once per STORE_RETRY_S, not on every flush
        store_up = self.store_outage.down_since is None or self.clock() - self._last_store_try >= STORE_RETRY_S
        for j in jobs:
            if not j.computed:
                try:
                    self._compute(j)
                except StoreUnavailable as exc:
                    self.stats.store_errors += 1
                    self.store_outage.failed(exc)
                    return False
            if not j.published:
                try:
                    self._publish(j)
                except Exception as exc:
                    self.stats.publish_errors += 1
                    self.kafka_outage.failed(exc)
                    return False
                self.kafka_outage.recovered()
            if store_up:
                store_up = self._store(j)
        return all(j.stored for j in jobs)

    def _compute(self, job: FlushJob) -> None:
        jobs = {w.key[:2] for w in job.windows if w.key[0] != NODE_TENANT}  # node windows have no model
        if self.scorer is not None:
            for tenant, name in jobs:
                try:  # restore models first: a failure here leaves no model half-fed
                    self.scorer.model(tenant, name)
                except Exception as exc:
                    raise StoreUnavailable(f"restoring the model of {tenant}/{name}: {exc}") from exc
        self.outbox.take()  # anything left by an interrupted job is recomputed below
        vectors = self.features.write(job.windows)
        if self.scorer is not None and job.windows:
            self.scorer.write(job.windows, vectors)
            now = self.clock()
            for key in jobs:
                self._job_scored_at[key] = now
        if self.scorer is not None and not job.earlier:  # only while nothing waits for the store (see below)
            self._evict_idle_models()
        inserts, job.messages = self.outbox.take()
        job.inserts = []
        if job.dead:
            job.inserts.append(self._dead_insert(job.dead, {id(r): b for b, r, _ in job.raw}))
        for table, columns, tok in inserts:
            job.inserts.append(row_insert(table, columns, tok, lambda row, why, table=table: self._reject_row(
                job, table, row, why)))
        self.dead.publish(job.dead)
        job.messages += self.outbox.take()[1]
        job.computed = True

    def _evict_idle_keys(self) -> None:
        """Loop thread: forget window keys idle past idle_evict_s, and the step membership of jobs
        that have no key left."""
        self.windows.evict_idle(self.cfg.idle_evict_s)
        live_jobs = {k[:2] for k in self.windows.keys} | {k[:2] for k in self.steps.pending}
        for job in [j for j in self.steps.members if j not in live_jobs]:
            del self.steps.members[job]

    def _evict_idle_models(self) -> None:
        """Flush thread: checkpoint, then drop, the models of jobs that scored nothing for idle_evict_s.
        The checkpoint goes out with this job's inserts. Only done while no earlier job waits for the
        store, so the checkpoint a returning job restores from is the newest."""
        now = self.clock()
        idle = [k for k in self.scorer.models
                if now - self._job_scored_at.setdefault(k, now) >= self.cfg.idle_evict_s]
        if not idle:
            return
        for k in idle:
            self.scorer.saved_at[k] = -float("inf")  # due: checkpoint() saves it now
        self.scorer.checkpoint()
        for k in idle:
            del self.scorer.models[k]
            del self.scorer.saved_at[k]
            del self._job_scored_at[k]
        self.evicted_models += len(idle)
        log.info("evicted %d idle job models after checkpointing them", len(idle))

    def _publish(self, job: FlushJob) -> None:
        if self.producer is None or not job.messages:
            job.published = True
            return
        for topic, key, value, headers in job.messages:
            self.producer.produce(topic, value=value, key=key, headers=headers)
        if self.producer.flush(10.0):
            raise RuntimeError("Kafka did not acknowledge the derived messages within 10 s")
        job.published = True

    def _store(self, job: FlushJob) -> bool:
        """Run the job's inserts in order; False if the store is unavailable (the job waits)."""
        self._last_store_try = self.clock()
        try:
            if job.raw_pending:  # raw rows last: the largest insert must not delay the others
                job.inserts += self.raw.inserts(job.raw, lambda item, why: self._reject_batch(job, item, why))
                job.raw_pending = False
            i = 0
            while i < len(job.inserts):
                job.inserts[i].run(self.store, on_error=lambda exc: setattr(self.stats, "store_errors",
                                                                            self.stats.store_errors + 1))
                if job.rejected:  # refused rows become dead letters, stored after the rest
                    rejected, job.rejected = job.rejected, []
                    self.dead.publish(rejected)
                    if self.producer is not None:
                        self._publish_now()
                    job.inserts.append(self._dead_insert(rejected, {id(r): b for b, r, _ in job.raw}))
                i += 1
        except StoreUnavailable as exc:
            self.store_outage.failed(exc)
            return False
        self.store_outage.recovered()
        return True

    def _publish_now(self) -> None:
        _, messages = self.outbox.take()
        for topic, key, value, headers in messages:
            self.producer.produce(topic, value=value, key=key, headers=headers)
        if self.producer.flush(10.0):
            log.warning("Kafka did not acknowledge %d dead letters within 10 s; they are in the dlq table",
                        len(messages))

    def _dead_insert(self, rows: list[DeadLetter], batches: dict) -> Insert:
        def lost(row: dict, why: str) -> None:  # a dead letter the store refuses cannot be dead-lettered
            log.error("the store refused a dead letter (%s); it is only in the log: %s", why, row)

        return row_insert("dlq", self.dead.columns(rows, batches), self.dead.token(rows), lost)

    def _reject_batch(self, job: FlushJob, item, why: str) -> None:
        batch, ref, value = item
        self.stats.store_rejected += 1
        self.stats.dlq += 1
        log.warning("dead-letter %s[%d]@%d: %s", ref.topic, ref.partition, ref.offset, why[:300])
        job.rejected.append((ref, value, why))

    def _reject_row(self, job: FlushJob, table: str, row: dict, why: str) -> None:
        self.stats.store_rejected += 1
        self.stats.dlq += 1
        ident = {k: row[k] for k in ("tenant", "job", "host", "rank", "window_start") if k in row}
        value = repr(ident).encode("utf-8", "backslashreplace")
        log.warning("dead-letter a %s row %s: %s", table, ident, why[:300])
        job.rejected.append((MessageRef(self.cfg.topic(table), -1, -1), value, why))

    def finish_flush(self, job: FlushJob, ok: bool) -> None:
        """Acknowledge what is stored (event-loop thread); the rest waits, in order."""
        waiting = []
        for j in job.earlier + [job]:
            if waiting or not j.stored:  # acknowledge in order: a stored job behind a waiting one waits too
                waiting.append(j)
                continue
            self._acknowledge(j)
        self._waiting = waiting + self._waiting
        self._pending_refs = [r for r in self._pending_refs if not r.acked]

    def _acknowledge(self, job: FlushJob) -> None:
        self.stats.flushes += 1
        if job.windows:
            self.stats.windows_out += len(job.windows)
            self.stats.last_window_end_ns = max(self.stats.last_window_end_ns, max(w.end_ns for w in job.windows))
        for ref in job.refs():
            ref.release()

    def flush(self, force: bool = False) -> None:
        """begin, run and finish in the caller's thread."""
        job = self.begin_flush(force)
        if job is not None:
            self.finish_flush(job, self.run_flush(job))

    def close(self) -> None:
        """Checkpoint every model now (at stop): a restarted worker resumes from here."""
        if self.scorer is None:
            return
        self.outbox.take()
        self.scorer.checkpoint(force=True)
        inserts, _ = self.outbox.take()
        for table, columns, tok in inserts:
            self.store.insert(table, columns, dedupe_token=tok)

    def snapshot(self) -> dict:
        s = asdict(self.stats)
        ws = self.windows.stats
        if self.scorer is not None:
            s.update({f"model_{k}": v for k, v in asdict(self.scorer.stats).items()})
        s.update(open_windows=len(self.windows.open), waiting_windows=self.steps.waiting_windows(),
                 late_events=ws.late_events, replayed_events=ws.replayed_events,
                 unacked_messages=len(self._pending_refs), unstored_jobs=len(self._waiting),
                 keys=len(self.windows.keys), evicted_keys=ws.evicted_keys, evicted_models=self.evicted_models,
                 store_down_s=(self.clock() - self.store_outage.down_since
                               if self.store_outage.down_since is not None else 0.0))
        return s
