"""Diagnoses and remediation log records as store columns and topic messages."""
from __future__ import annotations

from typing import Iterable

import numpy as np

from fleetscope.streams.diagnosis.matcher import Diagnosis
from fleetscope.streams.diagnosis.remediation import LogRecord


def diagnosis_message(d: Diagnosis) -> dict:
    """The `<prefix>.diagnoses` payload for one anomaly: every match, best first."""
    a = d.anomaly
    fp = d.attribution.fingerprint
    return {
        "tenant": a.tenant, "job": a.job, "host": a.host, "rank": int(a.rank),
        "window_start_ns": int(a.window_start_ns), "score": float(a.score), "threshold": float(a.threshold),
        "role": a.role, "culprit_ranks": [int(r) for r in a.culprit_ranks],
        "detectors": list(a.detectors), "fingerprint": fp.as_dict(), "fingerprint_unsigned": sorted(fp.unsigned),
        "top_features": [{"feature": f.feature, "subsystem": f.subsystem, "weight": f.weight, "sign": f.sign}
                         for f in d.attribution.top],
        "matches": [{"kb_entry": m.entry, "confidence": m.confidence, "similarity": m.similarity,
                     "rules_held": list(m.held), "evidence": m.evidence} for m in d.rows()],
    }


def diagnosis_columns(diagnoses: Iterable[Diagnosis], emitted_at_ns: int) -> dict:
    """Columns for the `diagnoses` table: one row per match, or one `unmatched` row."""
    rows = [(d, m) for d in diagnoses for m in d.rows()]
    n = len(rows)
    return {
        "tenant": [d.anomaly.tenant for d, _ in rows], "job": [d.anomaly.job for d, _ in rows],
        "host": [d.anomaly.host for d, _ in rows],
        "rank": np.array([d.anomaly.rank for d, _ in rows], dtype=np.int32),
        "window_start": np.array([d.anomaly.window_start_ns for d, _ in rows], dtype=np.int64),
        "kb_entry": [m.entry for _, m in rows],
        "confidence": np.array([m.confidence for _, m in rows], dtype=np.float32),
        "similarity": np.array([m.similarity for _, m in rows], dtype=np.float32),
        "fingerprint": [d.attribution.fingerprint.as_dict() for d, _ in rows],
        "fingerprint_unsigned": [sorted(d.attribution.fingerprint.unsigned) for d, _ in rows],
        "evidence": [dict(m.evidence) for _, m in rows],
        "rules_held": [list(m.held) for _, m in rows],
        "detectors": [list(d.anomaly.detectors) for d, _ in rows],
        "score": np.array([d.anomaly.score for d, _ in rows], dtype=np.float64),
        "threshold": np.array([d.anomaly.threshold for d, _ in rows], dtype=np.float64),
        "emitted_at": np.full(n, emitted_at_ns, dtype=np.int64),
    }


def remediation_log_columns(records: Iterable[LogRecord]) -> dict:
    recs = list(records)
    return {
        "ts": np.array([r.ts_ns for r in recs], dtype=np.int64),
        "record_id": [r.record_id for r in recs], "action_id": [r.action_id for r in recs],
        "tenant": [r.tenant for r in recs], "job": [r.job for r in recs], "host": [r.host for r in recs],
        "rank": np.array([r.rank for r in recs], dtype=np.int32),
        "window_start": np.array([r.window_start_ns for r in recs], dtype=np.int64),
        "kb_entry": [r.kb_entry for r in recs], "mode": [r.mode for r in recs], "status": [r.status for r in recs],
        "command": [r.command for r in recs], "reason": [r.reason for r in recs], "risk": [r.risk for r in recs],
        "exit_code": np.array([r.exit_code for r in recs], dtype=np.int32),
        "stdout_head": [r.stdout_head for r in recs], "stderr_head": [r.stderr_head for r in recs],
        "evidence_before": [r.evidence_before for r in recs], "evidence_after": [r.evidence_after for r in recs],
        "operator": [r.operator for r in recs],
    }
