"""Kafka messages of each topic as store rows.

- raw topics: decoded and admitted as the worker does (so a message the
  worker dead-letters is not stored as raw rows either), then one Arrow table
  per insert, built per batch with numpy (no per-row Python);
- features and scores (Arrow IPC, wire.decode): one row per window; the
  features topic also carries energy per operator (extras rows=operator_energy),
  stored in operator_energy, one row per window, basis and operator;
  a scores row flagged `waiting` also makes its anomalies row (waiting ranks
  never reach <prefix>.anomalies, which is for alerting), with the score and
  detectors, without the explanation maps;
- anomalies and diagnoses (JSON, schema in fleetscope/schemas/);
- dlq: one row per dead letter, from the headers the worker wrote;
- model-state: mirrored into model_state.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass

import numpy as np

from fleetscope.schema import validate
from fleetscope.wire import Batch, StrColumn, decode
from fleetscope.streams.admission import TimeBounds, check_key, check_strings
from fleetscope.streams.derived_codec import ANOMALY_SCHEMA, DIAGNOSIS_SCHEMA, schema_header
from fleetscope.streams.energy_features import is_energy_batch
from fleetscope.streams.model_state import JobState


@dataclass(eq=False)
class Record:
    """One Kafka message as the sink holds it."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: list

    def header(self, name: str) -> str | None:
        for k, v in self.headers or ():
            if k == name:
                return v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else str(v)
        return None

    def dead_letter_ident(self) -> str:
        """A dead letter names the message it holds: the embedded broker restarts offsets at 0 with every
        run, so topic/partition/offset alone would make a second run's dead letter a "duplicate"."""
        reason = (self.header("fs-dlq-reason") or "").encode("utf-8", "replace")
        digest = hashlib.sha1(bytes(self.value or b"") + b"\0" + reason).hexdigest()
        return "/".join([self.header("fs-dlq-topic") or "", self.header("fs-dlq-partition") or "",
                         self.header("fs-dlq-offset") or "", self.header("fs-dlq-msg-ts") or "", digest])

    def ident(self) -> str:
        digest = hashlib.sha1(bytes(self.value or b"")).hexdigest()[:16]
        return f"{self.topic}/{self.partition}/{self.offset}/{self.timestamp_ms}/{digest}"


def admitted_batch(rec: Record, bounds: TimeBounds) -> Batch:
    """The raw batch, or an exception: the worker dead-letters the same message, the sink skips it."""
    batch = decode(rec.value, rec.headers)
    validate(batch)
    check_strings(batch)
    bounds.check(batch.columns["ts_ns"])
    check_key(rec.key, batch)
    return batch


def _texts(col: StrColumn) -> list[str]:
    return [col.values[c] for c in col.codes.tolist()]


def _split(col: StrColumn) -> list[list[str]]:
    return [[p for p in s.split(",") if p] for s in _texts(col)]


def features_rows(batches: list[Batch]) -> dict:
    cols: dict[str, list] = {k: [] for k in ("tenant", "job", "host", "rank", "window_start", "window_end",
                                              "feature_version", "feature", "sources", "event_count", "emitted_at")}
    for b in batches:
        if is_energy_batch(b):  # energy per operator rides the features topic: operator_energy_rows
            continue
        c = b.columns
        names = [n for n in c if n.startswith("f.")]
        values = np.column_stack([c[n] for n in names]) if names else np.empty((b.count, 0))
        cols["tenant"] += _texts(c["tenant"])
        cols["job"] += _texts(c["job"])
        cols["host"] += _texts(c["host"])
        cols["rank"] += c["rank"].tolist()
        cols["window_start"] += c["window_start_ns"].tolist()
        cols["window_end"] += c["window_end_ns"].tolist()
        cols["feature_version"] += [int(b.extras.get("feature_version", 0))] * b.count
        cols["feature"] += [{n[2:]: float(v) for n, v in zip(names, row) if not math.isnan(v)}
                            for row in values.tolist()]
        cols["sources"] += _split(c["sources"])
        cols["event_count"] += c["event_count"].tolist()
        cols["emitted_at"] += c["emitted_at_ns"].tolist()
    return _typed(cols, ints={"rank": np.int32, "window_start": np.int64, "window_end": np.int64,
                              "feature_version": np.uint16, "event_count": np.uint32, "emitted_at": np.int64})


def operator_energy_rows(batches: list[Batch]) -> dict:
    """The energy-per-operator batches among the features topic's (streams/energy_features.py), as
    operator_energy rows; the feature batches are skipped (features_rows takes them)."""
    names = ("tenant", "job", "host", "rank", "window_start", "window_end", "basis", "operator", "busy_ns",
             "share", "energy_j", "collectives", "ops", "emitted_at")
    cols: dict[str, list] = {k: [] for k in names}
    for b in batches:
        if not is_energy_batch(b):
            continue
        c = b.columns
        for name in ("tenant", "job", "host", "basis", "operator"):
            cols[name] += _texts(c[name])
        for name in ("rank", "busy_ns", "share", "energy_j", "collectives", "ops"):
            cols[name] += c[name].tolist()
        cols["window_start"] += c["window_start_ns"].tolist()
        cols["window_end"] += c["window_end_ns"].tolist()
        cols["emitted_at"] += c["emitted_at_ns"].tolist()
    return _typed(cols, ints={"rank": np.int32, "window_start": np.int64, "window_end": np.int64,
                              "emitted_at": np.int64},
                  floats=("busy_ns", "share", "energy_j", "collectives", "ops"))


def scores_rows(batches: list[Batch]) -> tuple[dict, dict]:
    """The scores rows, and the anomalies rows of ranks flagged `waiting`."""
    cols: dict[str, list] = {k: [] for k in ("tenant", "job", "host", "rank", "window_start", "score", "threshold",
                                              "is_anomaly", "role", "detectors", "warm", "emitted_at")}
    for b in batches:
        c = b.columns
        cols["tenant"] += _texts(c["tenant"])
        cols["job"] += _texts(c["job"])
        cols["host"] += _texts(c["host"])
        cols["rank"] += c["rank"].tolist()
        cols["window_start"] += c["window_start_ns"].tolist()
        cols["score"] += c["score"].tolist()
        cols["threshold"] += c["threshold"].tolist()
        cols["is_anomaly"] += c["is_anomaly"].tolist()
        cols["role"] += _texts(c["role"])
        cols["detectors"] += _split(c["detectors"])
        cols["warm"] += c["warm"].tolist()
        cols["emitted_at"] += c["emitted_at_ns"].tolist()
    waiting = [i for i, (flag, role) in enumerate(zip(cols["is_anomaly"], cols["role"])) if flag and role == "waiting"]
    anomalies = {k: [cols[k][i] for i in waiting] for k in ("tenant", "job", "host", "rank", "window_start", "score",
                                                            "threshold", "detectors", "role", "emitted_at")}
    anomalies.update(contributions=[{} for _ in waiting], peer_z=[{} for _ in waiting], feature=[{} for _ in waiting])
    ints = {"rank": np.int32, "window_start": np.int64, "emitted_at": np.int64}
    return (_typed(cols, ints={**ints, "is_anomaly": np.uint8, "warm": np.uint8}, floats=("score", "threshold")),
            _typed(anomalies, ints=ints, floats=("score", "threshold")))


def json_record(rec: Record, schema: str) -> dict:
    got = rec.header("fs-schema")
    if got != schema:
        raise ValueError(f"fs-schema header {got!r}, expected {schema!r}")
    d = json.loads(rec.value)
    if not isinstance(d, dict):
        raise ValueError("the message is not a JSON object")
    return d


def anomalies_rows(rows: list[tuple[dict, int]]) -> dict:
    return _typed({
        "tenant": [a["tenant"] for a, _ in rows], "job": [a["job"] for a, _ in rows],
        "host": [a["host"] for a, _ in rows], "rank": [a["rank"] for a, _ in rows],
        "window_start": [a["window_start_ns"] for a, _ in rows], "score": [a["score"] for a, _ in rows],
        "threshold": [a["threshold"] for a, _ in rows], "detectors": [list(a["detectors"]) for a, _ in rows],
        "role": [a.get("role", "") for a, _ in rows], "contributions": [a["contributions"] for a, _ in rows],
        "peer_z": [a["peer_z"] for a, _ in rows], "feature": [a["features"] for a, _ in rows],
        "emitted_at": [at for _, at in rows]}, ints={"rank": np.int32, "window_start": np.int64,
                                                     "emitted_at": np.int64}, floats=("score", "threshold"))


def diagnoses_rows(rows: list[tuple[dict, int]]) -> dict:
    flat = [(d, m, at) for d, at in rows for m in d["matches"]]
    return _typed({
        "tenant": [d["tenant"] for d, _, _ in flat], "job": [d["job"] for d, _, _ in flat],
        "host": [d["host"] for d, _, _ in flat], "rank": [d["rank"] for d, _, _ in flat],
        "window_start": [d["window_start_ns"] for d, _, _ in flat], "kb_entry": [m["kb_entry"] for _, m, _ in flat],
        "confidence": [m["confidence"] for _, m, _ in flat], "similarity": [m["similarity"] for _, m, _ in flat],
        "fingerprint": [d["fingerprint"] for d, _, _ in flat],
        "fingerprint_unsigned": [list(d["fingerprint_unsigned"]) for d, _, _ in flat],
        "evidence": [m["evidence"] for _, m, _ in flat], "rules_held": [list(m["rules_held"]) for _, m, _ in flat],
        "detectors": [list(d["detectors"]) for d, _, _ in flat], "score": [d["score"] for d, _, _ in flat],
        "threshold": [d["threshold"] for d, _, _ in flat], "emitted_at": [at for _, _, at in flat]},
        ints={"rank": np.int32, "window_start": np.int64, "emitted_at": np.int64},
        floats=("score", "threshold", "confidence", "similarity"))


def dlq_rows(recs: list[Record], now_ns: int | None = None) -> dict:
    now = time.time_ns() if now_ns is None else now_ns
    topic = [r.header("fs-dlq-topic") or "" for r in recs]
    return {
        "ts": np.array([int(r.header("fs-dlq-ts-ns") or now) for r in recs], dtype=np.int64), "topic": topic,
        "partition": np.array([int(r.header("fs-dlq-partition") or -1) for r in recs], dtype=np.int32),
        "offset": np.array([int(r.header("fs-dlq-offset") or -1) for r in recs], dtype=np.int64),
        "reason": [r.header("fs-dlq-reason") or "" for r in recs], "source": [t.rsplit(".", 1)[-1] for t in topic],
        "host": [r.header("fs-dlq-host") or "" for r in recs], "batch_id": [r.header("fs-dlq-batch") or "" for r in recs],
        "size": np.array([len(r.value or b"") for r in recs], dtype=np.uint32),
        "payload_head": [bytes(r.value or b"")[:64].hex() for r in recs],
    }


def model_state_rows(states: list[JobState]) -> dict:
    return {"tenant": [s.tenant for s in states], "job": [s.job for s in states],
            "saved_at": np.array([s.saved_at_ns for s in states], dtype=np.int64),
            "last_window": np.array([max(s.last_window_ns, 0) // 10**6 * 10**6 for s in states], dtype=np.int64),
            "state": [s.model_b64 or "" for s in states],
            "marks": [_marks_only(s) for s in states]}


def _marks_only(s: JobState) -> str:
    return JobState(s.tenant, s.job, None, s.saved_at_ns, s.last_window_ns, s.marks).encode().decode()


def _typed(cols: dict, ints: dict | None = None, floats: tuple = ()) -> dict:
    out = dict(cols)
    for name, dtype in (ints or {}).items():
        out[name] = np.array(cols[name], dtype=dtype)
    for name in floats:
        out[name] = np.array(cols[name], dtype=np.float64)
    return out


JSON_SCHEMAS = {"anomalies": ANOMALY_SCHEMA, "diagnoses": DIAGNOSIS_SCHEMA}
__all__ = ["Record", "admitted_batch", "features_rows", "operator_energy_rows", "is_energy_batch", "scores_rows",
           "anomalies_rows", "diagnoses_rows", "dlq_rows", "model_state_rows", "json_record", "schema_header", "JSON_SCHEMAS"]
