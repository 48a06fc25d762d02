"""A generic JSON webhook payload that Slack's incoming webhooks also accept (`text` is what Slack shows);
the `fleetscope` object carries the incident for any other receiver."""
from __future__ import annotations

from fleetscope.streams.alerting.alertmanager import kb_text, labels, rfc3339, summary
from fleetscope.streams.alerting.incidents import Incident


def webhook_payload(inc: Incident, routing_labels: dict[str, str]) -> dict:
    status = "firing" if inc.firing else "resolved"
    icon = ":rotating_light:" if inc.firing else ":white_check_mark:"
    text = f"{icon} [{status.upper()}] {summary(inc)}. Diagnosis: {kb_text(inc)}. Max score {inc.max_score:.2f}."
    doc = {"status": status, "labels": labels(inc, routing_labels), "startsAt": rfc3339(inc.first_window_ns),
           "lastWindow": rfc3339(inc.last_window_ns), "windows": inc.windows, "maxScore": inc.max_score,
           "kbEntries": dict(inc.kb_entries)}
    if inc.resolved_at_ns is not None:
        doc["endsAt"] = rfc3339(inc.resolved_at_ns)
    return {"text": text, "fleetscope": doc}
