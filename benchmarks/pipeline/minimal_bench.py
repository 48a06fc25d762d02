"""The minimal pipeline, the yardstick the real one is compared with: a bare confluent-kafka consume
of a range of raw messages, wire.decode, one Arrow table per poll, one chDB Arrow insert per poll into
raw_metrics. No framework, no group, no dedupe, no isolation of bad rows. Runs in the bench process
against its own chDB."""
from __future__ import annotations

import time
import uuid

import numpy as np
import pyarrow as pa

from fleetscope.wire import StrColumn, decode


def rows_table(batches) -> pa.Table:
    """raw_metrics' columns from decoded batches, each concatenated once (plain strings, as chDB's
    Arrow insert takes them)."""
    counts = np.fromiter((b.count for b in batches), dtype=np.int64, count=len(batches))
    owner = pa.array(np.repeat(np.arange(len(batches), dtype=np.int32), counts))

    def strings(name):
        index: dict[str, int] = {}
        codes = []
        for b in batches:
            c: StrColumn = b.columns[name]
            remap = np.fromiter((index.setdefault(v, len(index)) for v in c.values), np.int32, len(c.values))
            codes.append(remap[c.codes])
        return pa.array(list(index), pa.string()).take(pa.array(np.concatenate(codes)))

    def per_batch(attr):
        return pa.array([getattr(b, attr) for b in batches], pa.string()).take(owner)

    def numbers(name):
        return pa.array(np.concatenate([b.columns[name] for b in batches]))

    ts = np.concatenate([b.columns["ts_ns"] for b in batches]).view("datetime64[ns]")
    return pa.table({"source": per_batch("source"), "tenant": strings("tenant"), "job": strings("job"),
                     "host": per_batch("host"), "rank": numbers("rank"), "pid": numbers("pid"), "gpu": numbers("gpu"),
                     "ts": pa.array(ts), "metric": strings("metric"), "device": strings("device"),
                     "value": numbers("value"), "interval_ns": numbers("interval_ns"),
                     "sample_frac": pa.array(np.ones(int(counts.sum())), pa.float64()),
                     "batch_id": per_batch("batch_id")})


def minimal_pipeline(bootstrap: str, topic: str, start: list[int], end: list[int], chdb_dir, poll_messages: int,
                     cap_s: float) -> dict:
    from confluent_kafka import Consumer, TopicPartition

    from fleetscope.store.chdb_store import ChdbStore
    store = ChdbStore(chdb_dir / f"minimal-{uuid.uuid4().hex[:6]}", "fleetscope", 7)
    store.migrate()
    expect = sum(e - s for s, e in zip(start, end))
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"minimal-{uuid.uuid4().hex[:8]}",
                  "enable.auto.commit": False, "fetch.wait.max.ms": 5, "fetch.min.bytes": 1,
                  "log.connection.close": False})
    n_msgs = n_events = inserts = 0
    t_consume = t_decode = t_table = t_insert = 0.0
    try:
        c.assign([TopicPartition(topic, p, off) for p, off in enumerate(end)])
        c.consume(num_messages=1, timeout=1.0)  # connect, metadata; nothing to read yet
        t0 = time.perf_counter()
        c.assign([TopicPartition(topic, p, off) for p, off in enumerate(start)])
        while n_msgs < expect and time.perf_counter() - t0 < cap_s:
            a = time.perf_counter()
            msgs = [m for m in c.consume(num_messages=poll_messages, timeout=0.1) if m.error() is None]
            b = time.perf_counter()
            if not msgs:
                t_consume += b - a
                continue
            batches = [decode(m.value(), m.headers()) for m in msgs]
            d = time.perf_counter()
            table = rows_table(batches)
            e = time.perf_counter()
            store.insert("raw_metrics", table, dedupe_token=f"minimal:{inserts}")
            f = time.perf_counter()
            t_consume, t_decode, t_table, t_insert = t_consume + b - a, t_decode + d - b, t_table + e - d, t_insert + f - e
            n_msgs += len(msgs)
            n_events += table.num_rows
            inserts += 1
        dt = time.perf_counter() - t0
        stored = int(store.query("SELECT count() FROM raw_metrics").rows[0][0])
    finally:
        c.close()
        store.close()
    per = lambda s: round(s / max(n_events, 1) * 1e6, 3)  # noqa: E731
    return {"events_per_s": round(n_events / dt) if n_msgs >= expect else None, "complete": n_msgs >= expect,
            "messages": n_msgs, "events": n_events, "rows_stored": stored, "seconds": round(dt, 2),
            "inserts": inserts, "poll_messages": poll_messages,
            "us_per_event": {"consume": per(t_consume), "decode": per(t_decode), "arrow_table": per(t_table),
                             "chdb_insert": per(t_insert)}}
