"""The stream worker's core, independent of Faust so it can be driven and tested directly.

For every message: decode, validate and admit it (see admission.py), fold
its events into windows. Any failure on that way sends the message to the
DLQ with the reason; `handle` never raises, so nothing is committed past
silently.

A flush job then goes through its steps, each done once and retried on its own:
1. compute: close ripe windows, build their feature rows, score them, and
   update each touched job's state (window marks, model checkpoint);
2. publish: features and scores (Arrow), anomalies and diagnoses (JSON),
   dead letters and the jobs' states (<prefix>.model-state) to Kafka. The
   flush thread does not wait for Kafka: each message's delivery callback
   counts its acknowledgement, and the job is published once all of them came
   back without error (seen when the producer is polled, at the next flush or
   finish_flush). A delivery error sends the job again, whole, and every later
   job already sent after it, in order (so a job's state is never overtaken by
   an older one); compute is not redone;
   a fatal producer error (a fenced or otherwise failed idempotent producer,
   KafkaError.fatal()) cannot be cured by resending: the processor records it
   in `fatal_error`, stops publishing, and the worker exits non-zero so it is
   restarted with a new producer (nothing is lost: nothing unacknowledged was
   committed);
3. only in-process (a store was given: tests, benchmarks, tools): the sink's
   TopicWriter stores what step 2 produced, as a sink would.
A worker does not write the store: sinks consume the raw and derived topics.
A message is acknowledged once every job holding it is published (stored,
in-process), in order: a job still waiting for Kafka holds back every later
one. Only acknowledged offsets are committed, so a crash replays instead of
losing. `flush()`, for callers on one thread (tests, benchmarks, tools), also
waits (up to 10 s) for the acknowledgements of what it sent.

Which windows are already out is the worker's own state, not the store's:
each job's window marks travel with its model on <prefix>.model-state
(model_state.py). A key first seen (after a start, a rebalance or an
eviction) reads its job's marks from there, and replayed windows at or
before a mark are acknowledged without being emitted again. Raw batches
are deduplicated by the sink.

A window is emitted by exactly one owner, with all its events. When the
group takes partitions away (`revoke`), their keys' open and step-held
windows are dropped, not flushed: their messages were never acknowledged,
so the new owner re-reads them from the committed offset, and the marks it
reads back cover only windows really emitted. The revoked jobs' states and
models are forgotten, so this worker no longer checkpoints them over the
new owner's.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import base64
import threading

from fleetscope.schema import validate
from fleetscope.wire import Batch, WireError, decode
from fleetscope.streams.admission import UNCHECKED_KEY, AdmissionError, TimeBounds, check_key, check_strings
from fleetscope.streams.energy_sink import OperatorEnergySink
from fleetscope.streams.model import JobModel
from fleetscope.streams.model_state import JobState
from fleetscope.streams.outage_log import OutageLog
from fleetscope.streams.outbox import Outbox
from fleetscope.streams.scoring import Scorer
from fleetscope.streams.seen_batches import SeenBatches
from fleetscope.streams.sink.tables import Record
from fleetscope.streams.sink.writer import TopicWriter, run_all
from fleetscope.streams.sinks import DeadLetters, FeatureSink
from fleetscope.streams.state_sources import JobStates, StoreStates
from fleetscope.streams.steps import JobSteps
from fleetscope.streams.store_writes import Insert, StoreUnavailable
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
    highwater: int | None = None  # the partition's end offset as the consumer last saw it (None: not known)
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
    publish_errors: int = 0  # failed sends and deliveries of derived messages (their jobs are sent again)
    dlq_publish_errors: int = 0  # in-process: store-rejected dead letters Kafka did not take (kept in the store)
    store_rejected: int = 0  # batches or rows the store refused, sent to the DLQ
    last_window_end_ns: int = 0


DeadLetter = tuple[MessageRef, "bytes | None", str]


# librdkafka's codes for a producer that can never deliver again: _FATAL (-150), PRODUCER_FENCED (90),
# INVALID_PRODUCER_EPOCH (47). Numbers, so this module does not import confluent-kafka.
FATAL_PRODUCER_CODES = frozenset((-150, 90, 47))


class Delivery:
    """One publish attempt of a job: the producer calls it once per message, when Kafka acknowledged it or
    gave up (confluent-kafka's on_delivery, fired by producer.poll/flush)."""

    def __init__(self, messages: int, on_result: Callable[[object], None]):
        self.pending = messages
        self.failed = False
        self.on_result = on_result

    def __call__(self, err, msg) -> None:
        self.pending -= 1
        self.failed |= err is not None
        self.on_result(err)

    def ok(self) -> bool:
        return self.pending <= 0 and not self.failed


@dataclass(eq=False)
class FlushJob:
    """One flush: taken on the event loop, advanced on the flush thread, acknowledged on the loop."""

    raw: list[tuple[Batch, MessageRef, bytes | None]]
    dead: list[DeadLetter]
    windows: list
    skipped: list[MessageRef]  # duplicates and replays: nothing to emit, acknowledged in order with the rest
    earlier: list["FlushJob"] = field(default_factory=list)  # jobs still waiting, oldest first
    computed: bool = False
    published: bool = False  # every message acknowledged by Kafka
    delivery: Delivery | None = None  # the publish attempt in flight (or failed): its acknowledgements
    messages: list = field(default_factory=list)
    inserts: list[Insert] | None = None  # in-process only: the sink's inserts for this job
    sunk: bool = False  # in-process only: stored

    def done(self, in_process: bool) -> bool:
        if not self.published and self.delivery is not None and self.delivery.ok():
            self.published = True
        return self.computed and self.published and (self.sunk or not in_process)

    def refs(self) -> list[MessageRef]:
        return ([ref for _, ref, _ in self.raw] + [ref for ref, _, _ in self.dead]
                + [ref for w in self.windows for ref in w.messages] + self.skipped)

    def unstored_rows(self) -> int:
        return sum(b.count for b, _, _ in self.raw)


class StreamProcessor:
    """`store`: given only to run in-process with a sink (tests, benchmarks, tools); a worker has none.
    `states`: where jobs' states are read back (ModelStateTopic for a worker; the store's model_state
    table in-process)."""

    def __init__(self, cfg, store=None, producer=None, clock=time.monotonic,
                 flush_interval_s: float = 0.25, flush_rows: int = 200_000, scoring: bool = True,
                 wall_clock_ns=time.time_ns, max_unstored_rows: int | None = None, states: JobStates | None = None):
        if store is None and producer is None:
            raise ValueError("a stream processor needs a producer (a worker) or a store (in-process)")
        if producer is not None and not callable(getattr(producer, "poll", None)):
            raise TypeError("the processor's producer must report deliveries (confluent-kafka's Producer: "
                            "produce(on_delivery=...) and poll); without them nothing would be acknowledged")
        self.cfg = cfg
        self.store = store
        self.producer = producer
        self.in_process = store is not None
        self.sink = TopicWriter(cfg, store, wall_clock_ns) if self.in_process else None
        self.states: JobStates = states if states is not None else StoreStates(store)
        self._input_partitions: set[tuple[str, int]] = set()  # read from since they were last revoked
        self.outbox = Outbox()
        self.features = FeatureSink(cfg, self.outbox)
        self.energy = OperatorEnergySink(cfg, self.outbox)  # energy per operator, on <prefix>.features
        self.dead = DeadLetters(cfg, self.outbox)
        self.windows = WindowAssembler(cfg.window_s, cfg.allowed_lateness_s, cfg.idle_close_s,
                                       stored_marks=self._mark, clock=clock)
        self.steps = JobSteps(cfg.step_hold_s, clock=clock)
        # the scorer's own inserts (scores, anomalies, diagnoses, model_state rows) are collected in the
        # outbox and not stored: the sink builds those rows from the topics; model_state rows become
        # the jobs' states on <prefix>.model-state (see _job_states)
        self.scorer = Scorer(cfg, self.outbox, self.outbox) if scoring else None
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
        self._waiting: list[FlushJob] = []  # computed, not yet published (or stored, in-process)
        self._last_flush = clock()
        self.flushes_in_flight = 0  # begun, not finished: a revoke waits for none to be left
        self._holding_flushes = False  # during a revoke: no flush begins
        self.revoked_windows = 0  # open windows handed over on a revoke (their events go to the new owner)
        self._last_store_try = -float("inf")
        self._pending_refs: list[MessageRef] = []
        self._last_evict_check = clock()
        self._job_scored_at: dict[tuple[str, str], float] = {}  # flush thread: when a job's model last scored
        self._job_states: dict[tuple[str, str], JobState] = {}
        self._states_lock = threading.Lock()  # marks are read on the loop thread, updated on the flush thread
        self._record_seq = 0
        self.evicted_models = 0
        self.store_outage = OutageLog(log, "store unavailable", cfg.store_error_log_s, clock)
        self.kafka_outage = OutageLog(log, "publishing to Kafka failed", cfg.store_error_log_s, clock)
        self.handling_errors = OutageLog(log, "a message failed after decoding (sent to the DLQ)",
                                         cfg.store_error_log_s, clock)
        self.fatal_error: str | None = None  # the producer cannot go on (see _note_fatal); the worker exits
        self.ack_order = None  # the worker's PartitionAckOrder (streams/app.py), for its gauge `held_acks`

    # ---- jobs' states -------------------------------------------------------------
    def _job_state(self, tenant: str, job: str) -> JobState:
        """The job's state, read back once from `states` (raises if it cannot be read: asked again later)."""
        with self._states_lock:
            st = self._job_states.get((tenant, job))
            if st is None:
                st = self.states.latest(tenant, job) or JobState(tenant, job)
                self._job_states[(tenant, job)] = st
            return st

    def _mark(self, key) -> int | None:
        return self._job_state(key[0], key[1]).marks.get((key[2], int(key[3])))

    def _ensure_model(self, tenant: str, job: str) -> None:
        key = (tenant, job)
        if key in self.scorer.models:
            return
        st = self._job_state(tenant, job)
        model = None
        if st.model_b64:
            try:
                model = JobModel.from_bytes(base64.b64decode(st.model_b64), self.scorer.parts(tenant, job))
                self.scorer.stats.restored_models += 1
                log.info("restored the model of %s/%s from <prefix>.model-state", tenant, job)
            except Exception:  # an unreadable or untrusted checkpoint: start afresh, visibly
                log.exception("model checkpoint of %s/%s unreadable; relearning", tenant, job)
        self.scorer.models[key] = model or JobModel(self.scorer.config_for(tenant))
        self.scorer.saved_at[key] = time.monotonic()
        self.scorer.stats.models += 1

    def _state_messages(self, windows, checkpoints: list) -> list:
        """Update the touched jobs' marks and models; their state messages for <prefix>.model-state."""
        touched = set()
        with self._states_lock:
            for w in windows:
                st = self._job_states.setdefault(w.key[:2], JobState(w.key[0], w.key[1]))
                mk = (w.key[2], int(w.key[3]))
                st.marks[mk] = max(st.marks.get(mk, -1), w.start_ns)
                st.last_window_ns = max(st.last_window_ns, w.start_ns)
                touched.add(w.key[:2])
            for _, columns, _ in checkpoints:
                for i, (tenant, job) in enumerate(zip(columns["tenant"], columns["job"])):
                    st = self._job_states.setdefault((tenant, job), JobState(tenant, job))
                    st.model_b64 = columns["state"][i]
                    touched.add((tenant, job))
            wall = time.time_ns()
            out = []
            for key in sorted(touched):
                st = self._job_states[key]
                st.saved_at_ns = wall
                out.append((self.cfg.topic("model-state"), st.key(), st.encode(), None))
            return out

    # ---- messages (event-loop thread) ------------------------------------------
    def handle(self, value: bytes | None, headers, ref: MessageRef, key=UNCHECKED_KEY) -> None:
        """Take one message. Never raises: whatever goes wrong sends it to the DLQ with the reason.

        `key` is the Kafka key; callers that do not read Kafka (tests, benchmarks) leave it out."""
        self.stats.messages_in += 1
        if (ref.topic, ref.partition) not in self._input_partitions:  # new here: its jobs' states, read again
            self._input_partitions.add((ref.topic, ref.partition))
            self.states.invalidate()
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
        """Too much waits (Kafka, or the store in-process): the consumer should wait too (backpressure)."""
        return self.raw_rows + sum(j.unstored_rows() for j in self._waiting) >= self.max_unstored_rows

    def begin_flush(self, force: bool = False) -> FlushJob | None:
        """Take what is ready (event-loop thread). Waiting jobs ride along, oldest first."""
        if self._holding_flushes:
            return None
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
        self.flushes_in_flight += 1
        return job

    def run_flush(self, job: FlushJob) -> bool:
        """Advance the waiting jobs and this one as far as they go (any thread). True if all are done.

        Jobs are computed and sent in order, and stop at the first that cannot be: a job's windows must
        reach its model, and its marks Kafka, in window order. Sending does not wait for Kafka's
        acknowledgements (see Delivery): a job still waiting for them is not done, and is looked at again
        by the next flush. A job whose delivery failed is sent again, and so is every later job that was
        sent after it, so that the newest state of a job stays the last one on <prefix>.model-state."""
        jobs = job.earlier + [job]
        if self.fatal_error is not None:  # resending through a failed producer would only fail again
            return False
        store_up = self.store_outage.down_since is None or self.clock() - self._last_store_try >= STORE_RETRY_S
        self._poll()
        resend = False
        for j in jobs:
            if not j.computed:
                try:
                    self._compute(j)
                except StoreUnavailable as exc:  # the jobs' states could not be read back
                    self.stats.publish_errors += 1
                    self.kafka_outage.failed(exc)
                    return False
            if j.delivery is not None and (j.delivery.failed or resend):
                resend = True
                j.delivery, j.published = None, False
            if not j.published and j.delivery is None:
                try:
                    self._publish(j)
                except Exception as exc:
                    self.stats.publish_errors += 1
                    self.kafka_outage.failed(exc)
                    self._note_fatal(exc.args[0] if exc.args else None)
                    return False
            if self.in_process and store_up and not j.sunk:
                store_up = self._sink(j)
        self._poll()
        return all(j.done(self.in_process) for j in jobs)

    def _poll(self) -> None:
        """Fire the delivery callbacks of what Kafka acknowledged meanwhile (never concurrently: the loop
        thread polls only while no flush runs on the flush thread)."""
        if self.producer is not None:
            self.producer.poll(0)

    def _delivered(self, err) -> None:
        """Every derived message's outcome: errors are counted and logged (once per period)."""
        if err is None:
            self.kafka_outage.recovered()
            return
        self.stats.publish_errors += 1
        self.kafka_outage.failed(RuntimeError(f"delivery failed: {err}"))
        self._note_fatal(err)

    def _note_fatal(self, err) -> None:
        """Record a fatal producer error: KafkaError.fatal(), or a delivery error that only comes from a
        producer that failed for good (an idempotent producer fenced after timed-out messages reports
        PRODUCER_FENCED per message, not fatal() on it; measured with tansu). Every later send fails the same
        way, so the worker must stop and start anew."""
        fatal = getattr(err, "fatal", None)
        code = getattr(err, "code", None)
        if self.fatal_error is None and ((callable(fatal) and fatal())
                                         or (callable(code) and code() in FATAL_PRODUCER_CODES)):
            self.fatal_error = f"the Kafka producer failed for good ({err}); restart the worker to get a new one"
            log.critical("%s", self.fatal_error)

    def _compute(self, job: FlushJob) -> None:
        jobs = {w.key[:2] for w in job.windows}  # node windows too: each node has a model (model/node.py)
        if self.scorer is not None:
            for tenant, name in jobs:
                try:  # restore models first: a failure here leaves no model half-fed
                    self._ensure_model(tenant, name)
                except Exception as exc:
                    raise StoreUnavailable(f"reading the state of {tenant}/{name}: {exc}") from exc
        self.outbox.take()  # anything left by an interrupted job is recomputed below
        vectors = self.features.write(job.windows)
        self.energy.write(job.windows)
        if self.scorer is not None and job.windows:
            self.scorer.write(job.windows, vectors)
            now = self.clock()
            for key in jobs:
                self._job_scored_at[key] = now
        if self.scorer is not None:
            self._evict_idle_models()
        self.dead.publish(job.dead, {id(r): b for b, r, _ in job.raw})
        inserts, messages = self.outbox.take()
        checkpoints = [i for i in inserts if i[0] == "model_state"]
        job.messages = messages + self._state_messages(job.windows, checkpoints)
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
        The checkpoint goes out with this job's messages, before anything later: a returning job
        restores the newest."""
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
        """Send the job's messages; their acknowledgements arrive later, counted by job.delivery."""
        if self.producer is None or not job.messages:
            job.published = True
            return
        delivery = Delivery(len(job.messages), self._delivered)
        for topic, key, value, headers in job.messages:
            self.producer.produce(topic, value=value, key=key, headers=headers, on_delivery=delivery)
        job.delivery = delivery

    def _sink(self, job: FlushJob) -> bool:
        """In-process: store the job's raw rows and messages as a sink would; False if the store is down."""
        self._last_store_try = self.clock()
        try:
            if job.inserts is None:
                job.inserts = self.sink.inserts(self._records(job.messages), admitted_raw=job.raw)
            run_all(job.inserts, self.store, on_error=lambda exc: setattr(self.stats, "store_errors",
                                                                          self.stats.store_errors + 1))
            rejected = self.sink.stats.store_rejected - self.stats.store_rejected
            if rejected > 0:
                self.stats.store_rejected += rejected
                self.stats.dlq += rejected
            dead = self.sink.dead_letter_insert()
            if dead is not None:
                insert, recs = dead
                job.inserts.append(insert)
                run_all([insert], self.store)
                if self.producer is not None:  # not waited for: they are in the dlq table; errors are counted
                    for r in recs:
                        self.producer.produce(self.cfg.topic("dlq"), value=r.value, key=r.key, headers=r.headers,
                                              on_delivery=self._dead_letter_delivered)
        except StoreUnavailable as exc:  # store_errors counted per failed insert by on_error
            self.store_outage.failed(exc)
            return False
        job.sunk = True
        self.store_outage.recovered()
        return True

    def _dead_letter_delivered(self, err, msg) -> None:
        if err is not None:
            self.stats.dlq_publish_errors += 1
            log.warning("Kafka did not take a dead letter the store rejected (%s); it is in the dlq table", err)

    def _records(self, messages) -> list[Record]:
        out = []
        now_ms = time.time_ns() // 10**6
        for topic, key, value, headers in messages:
            self._record_seq += 1
            out.append(Record(topic, -1, self._record_seq, now_ms, key, value, list(headers or ())))
        return out

    def finish_flush(self, job: FlushJob, ok: bool) -> None:
        """Acknowledge what is done (event-loop thread); the rest waits, in order."""
        self.flushes_in_flight -= 1
        self._poll()
        waiting = []
        for j in job.earlier + [job]:
            if waiting or not j.done(self.in_process):  # in order: a done job behind a waiting one waits too
                waiting.append(j)
                continue
            self._acknowledge(j)
        self._waiting = waiting + self._waiting
        self._pending_refs = [r for r in self._pending_refs if not r.acked]

    # ---- rebalances (event-loop thread) --------------------------------------------
    def hold_flushes(self, hold: bool) -> None:
        """While held, no flush begins: a revoke waits for the one in flight, then changes state that
        the flush thread reads."""
        self._holding_flushes = hold

    def revoke(self, partitions) -> None:
        """The group took these partitions (Faust TPs or (topic, partition) pairs) away. Call with no
        flush in flight (hold_flushes, then wait for flushes_in_flight to reach 0).

        Their keys' open windows, and closed ones held for their step, are dropped without being
        emitted: only their new owner emits them, whole, from the events it re-reads from the committed
        offset (nothing of theirs was acknowledged). The jobs' marks and models are forgotten: this
        worker no longer checkpoints them, and reads them back if the partitions return. Jobs already
        computed (waiting for Kafka) still publish: their windows were closed before the revoke."""
        tps = {(tp[0], int(tp[1])) for tp in partitions}  # Faust's TP is a (topic, partition) tuple
        if not tps:
            return
        self._input_partitions -= tps
        dropped, keys = self.windows.revoke(tps)
        held = []
        for step, ws in list(self.steps.pending.items()):
            mine = [w for w in ws if w.key in keys]
            if not mine:
                continue
            held += mine
            rest = [w for w in ws if w.key not in keys]
            if rest:
                self.steps.pending[step] = rest
            else:
                del self.steps.pending[step]
                del self.steps.first_seen[step]
        jobs = {k[:2] for k in keys}
        for job in jobs:
            self.steps.members.pop(job, None)
        with self._states_lock:
            for job in jobs:
                self._job_states.pop(job, None)
                self.states.forget(*job)
        if self.scorer is not None:
            for job in jobs:
                self.scorer.models.pop(job, None)
                self.scorer.saved_at.pop(job, None)
                self._job_scored_at.pop(job, None)
        # their messages are the new owner's now: never acknowledged here (a commit of them would be
        # refused, or, if the partition came back, would skip events not yet in a window)
        for ref in self._pending_refs:
            if (ref.topic, ref.partition) in tps:
                ref.acked = True
        self._pending_refs = [r for r in self._pending_refs if not r.acked]
        handed = [d for d in self._dead if (d[0].topic, d[0].partition) in tps]
        if handed:  # the new owner reads them again and dead-letters them itself
            self._dead = [d for d in self._dead if (d[0].topic, d[0].partition) not in tps]
            self.stats.dlq -= len(handed)
        self.seen = SeenBatches()  # their batches come again, and must be windowed again
        self.revoked_windows += len(dropped) + len(held)
        log.info("partitions revoked: handed over %d open windows of %d keys (%d jobs) to their new owner",
                 len(dropped) + len(held), len(keys), len(jobs))

    def _acknowledge(self, job: FlushJob) -> None:
        self.stats.flushes += 1
        if job.windows:
            self.stats.windows_out += len(job.windows)
            self.stats.last_window_end_ns = max(self.stats.last_window_end_ns, max(w.end_ns for w in job.windows))
        for ref in job.refs():
            ref.release()

    def flush(self, force: bool = False) -> None:
        """begin, run and finish in the caller's thread, waiting up to 10 s for Kafka's acknowledgements of
        what was sent (the worker's flush thread does not wait: see run_flush)."""
        job = self.begin_flush(force)
        if job is not None:
            ok = self.run_flush(job)
            if self.producer is not None:
                self.producer.flush(10.0)
            self.finish_flush(job, ok)

    def close(self) -> None:
        """Checkpoint every model now (at stop): a restarted worker resumes from here. Not through a producer that
        failed for good (fatal_error): the send could only fail, and the last periodic checkpoint stands."""
        if self.scorer is None or not self.scorer.models:
            return
        if self.fatal_error is not None:
            log.warning("no final model checkpoint: %s; the last periodic one stands", self.fatal_error)
            return
        self.outbox.take()
        self.scorer.checkpoint(force=True)
        inserts, _ = self.outbox.take()
        last = FlushJob([], [], [], [], computed=True)
        last.messages = self._state_messages([], [i for i in inserts if i[0] == "model_state"])
        self._publish(last)
        if self.producer is not None and (self.producer.flush(10.0) or not last.done(False)):
            raise RuntimeError("Kafka did not acknowledge the final model checkpoints within 10 s")
        if self.in_process:
            run_all(self.sink.inserts(self._records(last.messages)), self.store)

    def snapshot(self) -> dict:
        s = asdict(self.stats)
        ws = self.windows.stats
        if self.scorer is not None:
            s.update({f"model_{k}": v for k, v in asdict(self.scorer.stats).items()})
        s.update(fatal_error=self.fatal_error or "", open_windows=len(self.windows.open),
                 waiting_windows=self.steps.waiting_windows(),
                 late_events=ws.late_events, revoked_windows=self.revoked_windows, replayed_events=ws.replayed_events,
                 unacked_messages=len(self._pending_refs), unstored_jobs=len(self._waiting),
                 held_acks=self.ack_order.held if self.ack_order is not None else 0,
                 keys=len(self.windows.keys), evicted_keys=ws.evicted_keys, evicted_models=self.evicted_models,
                 partitions_behind=self.windows.partitions_behind, partition_end_unknown=ws.partition_end_unknown,
                 store_down_s=(self.clock() - self.store_outage.down_since
                               if self.store_outage.down_since is not None else 0.0))
        return s
