"""Alertmanager v2 payloads (POST /api/v2/alerts, the `postableAlerts` definition of its OpenAPI spec).

An incident's labels are its identity, so they never change while it fires: alertname, tenant, job, host,
rank, role and the tenant's routing labels. What changes (windows, score, KB entries, the newest window's anomaly_id) goes in annotations.
"""
from __future__ import annotations

from datetime import datetime, timezone

from fleetscope.anomaly_id import AnomalyId
from fleetscope.streams.alerting.incidents import Incident

ALERTNAME = "FleetscopeIncident"
API_PATH = "/api/v2/alerts"


def rfc3339(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def labels(inc: Incident, routing_labels: dict[str, str]) -> dict[str, str]:
    k = inc.key
    return {**routing_labels, "alertname": ALERTNAME, "tenant": k.tenant, "job": k.job, "host": k.host,
            "rank": str(k.rank), "role": inc.role, "source": "fleetscope"}


def summary(inc: Incident) -> str:
    k = inc.key
    return f"{k.tenant}/{k.job}: rank {k.rank} on {k.host} is the {inc.role} of an anomaly ({inc.windows} windows)"


def kb_text(inc: Incident) -> str:
    ranked = sorted(inc.kb_entries.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{e} ({c:.2f})" for e, c in ranked) or "not diagnosed yet"


def postable_alert(inc: Incident, routing_labels: dict[str, str]) -> dict:
    alert = {
        "labels": labels(inc, routing_labels),
        "annotations": {"summary": summary(inc), "kb_entries": kb_text(inc), "windows": str(inc.windows),
                        "max_score": f"{inc.max_score:.3f}", "threshold": f"{inc.threshold:.3f}",
                        "last_window": rfc3339(inc.last_window_ns)},
        "startsAt": rfc3339(inc.first_window_ns),
    }
    if inc.key.rank >= 0:  # its newest window, for `fleetscope trace --anomaly` (a job-wide incident has no rank)
        k = inc.key
        alert["annotations"]["anomaly_id"] = str(AnomalyId(k.tenant, k.job, k.rank, inc.last_window_ns))
    if inc.resolved_at_ns is not None:
        alert["endsAt"] = rfc3339(inc.resolved_at_ns)
    return alert
