"""Raw rows as one Arrow table for the store (RawSink, used by the sink), feature rows as
<prefix>.features batches (FeatureSink), dead letters on <prefix>.dlq (DeadLetters)."""
from __future__ import annotations

import hashlib
import logging
import socket
import time

import numpy as np
import pyarrow as pa

from fleetscope import wire
from fleetscope.schema import PLACEMENT_COLUMNS, SOURCE_COLUMNS
from fleetscope.wire import Batch, StrColumn
from fleetscope.streams.arrival import ArrivalOrder
from fleetscope.streams.features import FEATURE_VERSION, window_features
from fleetscope.streams.store_writes import Insert, StoreUnavailable, store_answers

log = logging.getLogger(__name__)

RAW_TABLE = {source: "raw_metrics" for source in SOURCE_COLUMNS}
REPLAY_LOOKBACK_S = 900  # batch ids the store took this recently count as "already stored" after a restart


def token(kind: str, ids) -> str:
    return f"{kind}:" + hashlib.sha1("\n".join(ids).encode()).hexdigest()


class RawSink:
    """Stores raw rows. Safe to call from the flush thread."""

    def __init__(self, store):
        self.store = store
        self._stored_before: set[str] | None = None
        self.replayed_batches = 0

    def _already_stored(self) -> set[str]:
        if self._stored_before is None:  # once per run: what a previous run stored
            res = self.store.query(
                # by when the store took them, not by event time: a replayed batch may hold old events
                "SELECT DISTINCT batch_id FROM raw_metrics WHERE ingested_at >= fromUnixTimestamp64Nano({since:Int64})",
                {"since": time.time_ns() - REPLAY_LOOKBACK_S * 10**9})
            self._stored_before = {r[0] for r in res.rows}
        return self._stored_before

    def inserts(self, items: list[tuple[Batch, object, bytes | None]], reject) -> list[Insert]:
        """One isolating insert per table for these (batch, message, value) items; a batch the store
        refuses goes to `reject(item, reason)`. Raises StoreUnavailable if the replay check cannot run."""
        if not items:
            return []
        try:
            stored_before = self._already_stored()
        except Exception as exc:
            raise StoreUnavailable(f"reading the batch ids already stored: {exc}") from exc
        by_table: dict[str, list] = {}
        for item in items:
            if item[0].batch_id in stored_before:
                self.replayed_batches += 1
                continue
            by_table.setdefault(RAW_TABLE[item[0].source], []).append(item)
        return [Insert(table, group, lambda g: self._metric_rows([b for b, _, _ in g]),
                       lambda g, table=table: token(table, [b.batch_id for b, _, _ in g]), reject)
                for table, group in by_table.items()]

    def write(self, batches: list[Batch]) -> list[tuple[Batch, str]]:
        """Store these batches now (benchmarks, tests); returns the batches the store refused, with why."""
        refused: list[tuple[Batch, str]] = []
        for ins in self.inserts([(b, None, None) for b in batches], lambda item, why: refused.append((item[0], why))):
            while not ins.done:  # a refused batch is tried REJECT_AFTER times, then handed to `refused`
                try:
                    ins.run(self.store)
                except StoreUnavailable:
                    if not store_answers(self.store):
                        raise
        return refused

    @staticmethod
    def _metric_rows(batches: list[Batch]) -> pa.Table:
        """Raw rows as one Arrow table: each column concatenated in numpy first (one array, not one chunk per
        batch: a table of hundreds of small chunks made chDB's insert several times slower)."""
        counts = np.fromiter((b.count for b in batches), dtype=np.int64, count=len(batches))

        def column(name, cols=None):
            cols = [b.columns[name] for b in batches] if cols is None else cols
            if isinstance(cols[0], StrColumn):  # one dictionary of distinct values for all batches, one take
                index: dict[str, int] = {}
                codes = [np.fromiter((index.setdefault(v, len(index)) for v in c.values), dtype=np.int32,
                                     count=len(c.values))[c.codes] for c in cols]
                return pa.array(list(index), pa.string()).take(pa.array(np.concatenate(codes)))
            return pa.array(np.concatenate(cols))

        def placement(name):  # only process rows carry pod/namespace/container; other batches store ''
            if not any(name in b.columns for b in batches):
                return None
            return column(name, [b.columns[name] if name in b.columns else StrColumn.constant("", b.count)
                                 for b in batches])

        def per_batch(attr):
            return pa.array([getattr(b, attr) for b in batches], pa.string()).take(
                pa.array(np.repeat(np.arange(len(batches), dtype=np.int32), counts)))

        # sampled (duty-cycled) sources carry sample_frac; everything else saw all events
        frac = np.concatenate([b.columns["sample_frac"] if "sample_frac" in b.columns else np.ones(b.count)
                               for b in batches])
        ts = pa.array(np.concatenate([b.columns["ts_ns"] for b in batches]).view("datetime64[ns]"))
        table = {"source": per_batch("source"), "tenant": column("tenant"), "job": column("job"),
                 "host": per_batch("host"), "rank": column("rank"), "pid": column("pid"), "gpu": column("gpu")}
        table.update({name: col for name in PLACEMENT_COLUMNS if (col := placement(name)) is not None})
        table.update({"ts": ts, "metric": column("metric"), "device": column("device"), "value": column("value"),
                      "interval_ns": column("interval_ns"), "sample_frac": pa.array(frac, pa.float64()),
                      "batch_id": per_batch("batch_id")})
        return pa.table(table)


class FeatureSink:
    """Builds the windows' feature vectors and publishes them on <prefix>.features (Arrow, one message per job)."""

    def __init__(self, cfg, producer):
        self.cfg = cfg
        self.producer = producer
        self.host = socket.gethostname()
        self.arrival = ArrivalOrder()

    def write(self, windows) -> list[dict]:
        """Publish the windows' feature rows; returns their vectors."""
        if not windows:
            return []
        vectors = [window_features(w) for w in windows]
        self.arrival.add(windows, vectors)  # across each step's ranks: who entered each collective last
        self._publish(windows, vectors)
        return vectors

    def _publish(self, windows, vectors) -> None:
        by_job: dict[tuple[str, str], list[int]] = {}
        for i, w in enumerate(windows):
            by_job.setdefault((w.key[0], w.key[1]), []).append(i)
        topic = self.cfg.topic("features")
        for (tenant, job), idx in by_job.items():
            batch = features_batch(self.host, [windows[i] for i in idx], [vectors[i] for i in idx])
            self.producer.produce(topic, key=f"{tenant}/{job}".encode(), value=wire.encode(batch),
                                  headers=batch.kafka_headers())


def features_batch(worker_host: str, windows, vectors) -> Batch:
    """Feature rows as one columnar batch: `f.<name>` columns, NaN where masked."""
    names = sorted({k for v in vectors for k in v})
    cols = {
        "window_start_ns": np.array([w.start_ns for w in windows], dtype="<i8"),
        "window_end_ns": np.array([w.end_ns for w in windows], dtype="<i8"),
        "tenant": StrColumn.of([w.key[0] for w in windows]), "job": StrColumn.of([w.key[1] for w in windows]),
        "host": StrColumn.of([w.key[2] for w in windows]),
        "rank": np.array([w.key[3] for w in windows], dtype="<i4"),
        "event_count": np.array([w.event_count for w in windows], dtype="<u4"),
        "sources": StrColumn.of([",".join(sorted(w.sources)) for w in windows]),
        "emitted_at_ns": np.full(len(windows), time.time_ns(), dtype="<i8"),
    }
    for name in names:
        cols[f"f.{name}"] = np.array([v.get(name, np.nan) for v in vectors], dtype="<f8")
    return Batch("features", worker_host, cols, extras={"feature_version": FEATURE_VERSION})


class DeadLetters:
    """Messages the worker could not take (undecodable, invalid, out of bounds), with the reason,
    published to `<prefix>.dlq`: the original bytes, and headers naming the message and the reason.
    The sink stores them in `dlq`. A sink's row is deduplicated by the dead letter's own topic,
    partition, offset, broker timestamp and content: the embedded broker restarts offsets at 0 with
    every run, so topic/partition/offset alone made a second run's dead letter a "duplicate"."""

    def __init__(self, cfg, producer):
        self.cfg = cfg
        self.producer = producer

    def publish(self, rows, batches: dict | None = None) -> None:
        known = batches or {}
        now = str(time.time_ns()).encode()
        for ref, value, reason in rows:
            batch = known.get(id(ref))
            self.producer.produce(self.cfg.topic("dlq"), value=value, headers=[
                ("fs-dlq-reason", reason.encode("utf-8", "replace")), ("fs-dlq-topic", ref.topic.encode()),
                ("fs-dlq-partition", str(ref.partition).encode()), ("fs-dlq-offset", str(ref.offset).encode()),
                ("fs-dlq-ts-ns", now), ("fs-dlq-msg-ts", str(getattr(ref, "timestamp_ms", 0)).encode()),
                ("fs-dlq-host", (batch.host if batch else "").encode()),
                ("fs-dlq-batch", (batch.batch_id if batch else "").encode())])
