"""One object for the stream worker: anomalies in, topic messages and store columns out.

    diagnoser = Diagnoser()                      # loads and validates kb/*.yaml once
    out = diagnoser.handle(anomalies, emitted_at_ns=time.time_ns())
    producer: one message per out.messages item on <prefix>.diagnoses (key tenant/job)
    store.insert("diagnoses", out.columns, dedupe_token=<the anomalies batch id>)

Nothing here executes a remediation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from fleetscope.streams.diagnosis.anomaly import Anomaly
from fleetscope.streams.diagnosis.kb import KB_DIR, Entry, load_kb
from fleetscope.streams.diagnosis.matcher import Diagnosis, diagnose
from fleetscope.streams.diagnosis.records import diagnosis_columns, diagnosis_message


@dataclass
class DiagnosisBatch:
    diagnoses: list[Diagnosis]
    messages: list[dict]
    columns: dict
    unmatched: int = 0
    rejected: list[str] = field(default_factory=list)  # anomalies that could not be read, with why


class Diagnoser:
    def __init__(self, kb: Mapping[str, Entry] | None = None, kb_dir: Path = KB_DIR, min_confidence: float = 0.0):
        self.kb = dict(kb) if kb is not None else load_kb(kb_dir)
        self.min_confidence = min_confidence
        self.counts = {"anomalies": 0, "matched": 0, "unmatched": 0, "rejected": 0}

    def handle(self, anomalies: Iterable[Anomaly | Mapping], emitted_at_ns: int) -> DiagnosisBatch:
        diagnoses, rejected = [], []
        for a in anomalies:
            try:
                anomaly = a if isinstance(a, Anomaly) else Anomaly.from_dict(a)
            except (TypeError, ValueError) as exc:
                rejected.append(str(exc))
                continue
            diagnoses.append(diagnose(anomaly, self.kb, self.min_confidence))
        unmatched = sum(1 for d in diagnoses if not d.matches)
        self.counts["anomalies"] += len(diagnoses) + len(rejected)
        self.counts["matched"] += len(diagnoses) - unmatched
        self.counts["unmatched"] += unmatched
        self.counts["rejected"] += len(rejected)
        return DiagnosisBatch(diagnoses, [diagnosis_message(d) for d in diagnoses],
                              diagnosis_columns(diagnoses, emitted_at_ns), unmatched, rejected)
