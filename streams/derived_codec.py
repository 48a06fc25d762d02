"""Headers of the derived JSON topics.

<prefix>.anomalies and <prefix>.diagnoses are JSON (alert consumers expect
it). Each message carries `fs-schema: anomaly/1` or `diagnosis/1`; the
schemas are src/fleetscope/schemas/*.schema.json. A consumer refuses a
version it does not know. Features and scores are Arrow IPC (wire.py),
sources "features" and "scores".
"""
from __future__ import annotations

ANOMALY_SCHEMA = "anomaly/1"
DIAGNOSIS_SCHEMA = "diagnosis/1"
SCHEMA_FILES = {ANOMALY_SCHEMA: "anomaly.schema.json", DIAGNOSIS_SCHEMA: "diagnosis.schema.json"}


def schema_header(schema: str) -> list[tuple[str, bytes]]:
    return [("fs-schema", schema.encode())]
