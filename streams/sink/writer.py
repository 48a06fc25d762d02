"""Turns a poll's worth of Kafka records into store inserts, and runs them.

Every insert isolates what the store refuses (store_writes.Insert: bisect,
then dead-letter a part refused REJECT_AFTER times) and carries a dedupe
token derived from its content, so a retry stores nothing twice. The tables
dedupe by key and window as well (ReplacingMergeTree), so a window the worker
published twice (a replay after a crash) is one row under FINAL.

Raw topics: a record the worker dead-letters (undecodable, not admitted) is
skipped here and counted (`raw_skipped`): the worker's dead letter on
<prefix>.dlq is what gets stored. Raw batches seen twice in this run, or
stored by an earlier run (RawSink's replay check), are not stored again.

traces (JSON, fs-schema trace/1): one trace_events row per captured call.

Refused parts become dead letters: stored in `dlq` directly, and handed to
`on_dead` (the consumer publishes them to <prefix>.dlq, marked as stored).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from fleetscope.topics import RAW_SOURCES
from fleetscope.trace_message import TRACE_SCHEMA
from fleetscope.wire import decode
from fleetscope.streams.admission import TimeBounds
from fleetscope.streams.derived_codec import ANOMALY_SCHEMA, DIAGNOSIS_SCHEMA
from fleetscope.streams.model_state import JobState
from fleetscope.streams.seen_batches import SeenBatches
from fleetscope.streams.sink import tables
from fleetscope.streams.sink.tables import Record
from fleetscope.streams.sink.trace_rows import trace_events_rows
from fleetscope.streams.sinks import RawSink, token
from fleetscope.streams.store_writes import Insert, row_insert

log = logging.getLogger(__name__)
STORED_HEADER = "fs-dlq-stored"  # a dead letter the sink already stored itself


@dataclass
class SinkStats:
    records: int = 0
    raw_rows: int = 0
    raw_skipped: int = 0  # dead-lettered by the worker
    duplicate_batches: int = 0
    derived_rows: int = 0
    unreadable: int = 0  # derived records that did not decode: dead-lettered
    store_rejected: int = 0
    dlq_rows: int = 0


class TopicWriter:
    def __init__(self, cfg, store, wall_clock_ns=None):
        self.cfg = cfg
        self.store = store
        self.raw = RawSink(store)
        self.bounds = TimeBounds(cfg.ttl_days, cfg.max_future_skew_s, *(wall_clock_ns and [wall_clock_ns] or []))
        self.seen = SeenBatches()
        self.stats = SinkStats()
        self.dead: list[tuple[Record, str]] = []  # refused or unreadable: stored in dlq and handed to on_dead
        self._raw_topics = {cfg.raw_topic(s) for s in RAW_SOURCES}
        self._kinds = {cfg.topic(k): k for k in ("features", "scores", "anomalies", "diagnoses", "dlq", "model-state",
                                                 "traces")}

    def forget_replays(self) -> None:
        """After a rebalance: ask the store again which batches an earlier owner stored."""
        self.raw = RawSink(self.store)

    def inserts(self, records: list[Record], admitted_raw: list | None = None) -> list[Insert]:
        """The inserts for these records, and for raw (batch, ref, value) items a caller already admitted
        (a processor run in-process). Raises StoreUnavailable if the replay check cannot reach the store."""
        self.stats.records += len(records)
        raw, parts = list(admitted_raw or ()), {}
        for rec in records:
            if rec.topic in self._raw_topics:
                try:
                    batch = tables.admitted_batch(rec, self.bounds)
                except Exception:  # the worker dead-letters it with the reason
                    self.stats.raw_skipped += 1
                    continue
                if not self.seen.add(batch.batch_id):
                    self.stats.duplicate_batches += 1
                    continue
                raw.append((batch, rec, rec.value))
                continue
            kind = self._kinds.get(rec.topic)
            if kind is None:
                continue
            try:
                part = self._parse(kind, rec)
            except Exception as exc:
                self.stats.unreadable += 1
                self.dead.append((rec, f"unreadable {kind} message: {type(exc).__name__}: {str(exc)[:300]}"))
                continue
            if part is not None:
                parts.setdefault(kind, []).append((part, rec))
        out = self._derived(parts)
        out += self.raw.inserts(raw, lambda item, why: self._refused(_as_record(item), why))
        self.stats.raw_rows += sum(b.count for b, _, _ in raw)
        return out

    def _parse(self, kind: str, rec: Record):
        if kind in ("features", "scores"):
            batch = decode(rec.value, rec.headers)
            if batch.source != kind:
                raise ValueError(f"a {batch.source!r} batch on the {kind} topic")
            return batch
        if kind == "anomalies":
            return tables.json_record(rec, ANOMALY_SCHEMA)
        if kind == "diagnoses":
            return tables.json_record(rec, DIAGNOSIS_SCHEMA)
        if kind == "traces":
            return tables.json_record(rec, TRACE_SCHEMA)
        if kind == "dlq":
            return None if rec.header(STORED_HEADER) else rec
        if rec.value is None:  # a compaction tombstone
            return None
        return JobState.decode(rec.value)

    def _derived(self, parts: dict) -> list[Insert]:
        out = []

        def add(table, items, build):
            if not items:
                return
            ident = lambda group: token(table, [rec.dead_letter_ident() if table == "dlq" else rec.ident()  # noqa: E731
                                                for _, rec in group])
            out.append(Insert(table, items, build, ident, lambda item, why: self._refused(item[1], why)))
            self.stats.derived_rows += len(items)

        emitted = lambda rec: rec.timestamp_ms * 1_000_000  # noqa: E731
        add("features", parts.get("features"), lambda g: tables.features_rows([b for b, _ in g]))
        add("operator_energy", [p for p in parts.get("features", ()) if tables.is_energy_batch(p[0])],
            lambda g: tables.operator_energy_rows([b for b, _ in g]))
        add("scores", parts.get("scores"), lambda g: tables.scores_rows([b for b, _ in g])[0])
        waiting = [(b, rec) for b, rec in parts.get("scores", ())
                   if (b.columns["role"].values and "waiting" in b.columns["role"].values)]
        add("anomalies", waiting, lambda g: tables.scores_rows([b for b, _ in g])[1])
        add("anomalies", parts.get("anomalies"), lambda g: tables.anomalies_rows([(a, emitted(r)) for a, r in g]))
        add("diagnoses", parts.get("diagnoses"), lambda g: tables.diagnoses_rows([(d, emitted(r)) for d, r in g]))
        add("trace_events", parts.get("traces"), lambda g: trace_events_rows([(m, emitted(r)) for m, r in g]))
        add("dlq", parts.get("dlq"), lambda g: tables.dlq_rows([r for r, _ in g]))
        add("model_state", parts.get("model-state"), lambda g: tables.model_state_rows([s for s, _ in g]))
        return out

    def _refused(self, rec: Record, why: str) -> None:
        self.stats.store_rejected += 1
        log.warning("dead-letter %s[%d]@%d: %s", rec.topic, rec.partition, rec.offset, why[:300])
        self.dead.append((rec, why))

    def dead_letter_insert(self) -> tuple[Insert, list[Record]] | None:
        """The pending dead letters as one dlq insert, and as records to publish (marked as stored)."""
        if not self.dead:
            return None
        dead, self.dead = self.dead, []
        self.stats.dlq_rows += len(dead)
        recs = [dead_record(rec, why) for rec, why in dead]

        def lost(row, why):  # a dead letter the store refuses cannot be dead-lettered
            log.error("the store refused a dead letter (%s); it is only in the log: %s", why, row)

        return row_insert("dlq", tables.dlq_rows(recs), token("dlq", [r.dead_letter_ident() for r in recs]),
                          lost), recs


def _as_record(item) -> Record:
    batch, ref, value = item
    if isinstance(ref, Record):
        return ref
    return Record(ref.topic, ref.partition, ref.offset, getattr(ref, "timestamp_ms", 0), None, value,
                  [("fs-dlq-host", batch.host.encode()), ("fs-dlq-batch", batch.batch_id.encode())])


def dead_record(rec: Record, why: str) -> Record:
    """A refused or unreadable record as a dead letter, in the shape the worker publishes them."""
    headers = [("fs-dlq-reason", why.encode("utf-8", "replace")), ("fs-dlq-topic", rec.topic.encode()),
               ("fs-dlq-partition", str(rec.partition).encode()), ("fs-dlq-offset", str(rec.offset).encode()),
               ("fs-dlq-msg-ts", str(rec.timestamp_ms).encode()), (STORED_HEADER, b"1")] + [(k, v) for k, v in rec.headers or () if k in ("fs-dlq-host", "fs-dlq-batch")]
    return Record(rec.topic, rec.partition, rec.offset, rec.timestamp_ms, rec.key, rec.value, headers)


def run_all(inserts: list[Insert], store, on_error=lambda exc: None) -> None:
    """Run every insert to the end (raises StoreUnavailable; the inserts keep what is left)."""
    for ins in inserts:
        ins.run(store, on_error=on_error)

