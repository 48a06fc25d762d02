"""`fleetscope alert` delivery, end to end: the real embedded broker, the real alert service and consumer, and a
real HTTP receiver on loopback (http.server in a thread) standing in for Alertmanager and a webhook, which are
not installed here. Every Alertmanager payload is validated against the `postableAlerts` definition of
Alertmanager's own OpenAPI spec (deploy/schemas/alertmanager-v2-openapi.yaml)."""
from __future__ import annotations

import json

import jsonschema
import pytest
from confluent_kafka import Producer

from support.alert_receiver import (  # noqa: F401 - receiver is a fixture
    VALIDATOR, alert_services, anomaly, check_postable, committed_total, diagnosis, publish, receiver, wait_for)


@pytest.fixture()
def run_service(pipeline_cfg, broker, receiver):
    with alert_services(pipeline_cfg, broker, receiver, alert_tenant_labels=("acme:team=ml-infra",)) as start:
        yield start


def test_the_postable_alerts_schema_rejects_a_non_string_label():
    """The validator the other tests rely on can fail: a label value must be a string."""
    with pytest.raises(jsonschema.ValidationError):
        VALIDATOR.validate([{"labels": {"rank": 2}}])
    with pytest.raises(jsonschema.ValidationError):
        VALIDATOR.validate([{"annotations": {}}])  # labels are required


def test_windows_are_grouped_per_incident_deduplicated_and_resolved(pipeline_cfg, broker, receiver, run_service):
    receiver.up()
    cfg = pipeline_cfg
    straggler = [anomaly("acme", "train-1", "h1", 2, w, score=30 + w) for w in range(5)]
    other = [anomaly("beta", "eval-2", "h3", 0, 0)]
    publish(broker, cfg.topic("anomalies"), straggler + other + straggler[:2])  # two windows delivered twice
    publish(broker, cfg.topic("diagnoses"), [diagnosis(a, "cpu_contention", 0.8) for a in straggler])
    svc = run_service(alert_resolve_s=2.0, alert_resend_s=3600.0)

    resolved = wait_for(lambda: [a for a in receiver.alertmanager() if "endsAt" in a] if
                        len([a for a in receiver.alertmanager() if "endsAt" in a]) == 2 else None, 90,
                        "both incidents resolved in Alertmanager")
    with receiver.lock:
        for path, body in receiver.posts:
            if path == "/api/v2/alerts":
                check_postable(body)
    incidents = {(a["labels"]["tenant"], a["labels"]["job"], a["labels"]["rank"], a["labels"]["host"])
                 for a in receiver.alertmanager()}
    assert incidents == {("acme", "train-1", "2", "h1"), ("beta", "eval-2", "0", "h3")}  # one per incident
    acme = [a for a in resolved if a["labels"]["tenant"] == "acme"][0]
    assert acme["labels"]["team"] == "ml-infra" and acme["annotations"]["windows"] == "5"
    assert acme["annotations"]["kb_entries"] == "cpu_contention (0.80)"
    # the newest window's anomaly, as `fleetscope trace --anomaly` takes it
    assert acme["annotations"]["anomaly_id"] == f"acme/train-1/2/{straggler[-1]['window_start_ns']}"
    assert "team" not in [a for a in resolved if a["labels"]["tenant"] == "beta"][0]["labels"]
    assert acme["startsAt"] < acme["endsAt"]
    # the webhook hears of each incident twice: opened and resolved. Its posts follow Alertmanager's in each
    # delivery, so the last one may still be on its way when Alertmanager has both resolutions.
    hooks = wait_for(lambda: receiver.webhook() if len(receiver.webhook()) >= 4 else None, 30,
                     "four webhook posts")
    assert sorted((h["fleetscope"]["labels"]["job"], h["fleetscope"]["status"]) for h in hooks) == [
        ("eval-2", "firing"), ("eval-2", "resolved"), ("train-1", "firing"), ("train-1", "resolved")]
    assert all(h["text"] for h in hooks)
    # the service counts a resolution once every post of its delivery is through, just after the last one
    # reaches the receiver: wait for the count rather than read it the moment the posts are seen
    wait_for(lambda: svc.stats.incidents_resolved == 2, 30, "both resolutions counted")
    assert svc.stats.bad_records == 0 and svc.stats.incidents_opened == 2 and svc.stats.incidents_resolved == 2
    wait_for(lambda: committed_total(broker, cfg, svc.group) == len(straggler) + 3 + len(straggler), 30,
             "every message committed after delivery")


def test_nothing_is_lost_or_committed_while_the_receiver_is_down(pipeline_cfg, broker, receiver, run_service):
    cfg = pipeline_cfg
    receiver.up()
    svc = run_service(alert_resolve_s=3600.0, alert_resend_s=3600.0)
    publish(broker, cfg.topic("anomalies"), [anomaly("acme", "train-1", "h1", 2, 0)])
    wait_for(lambda: len(receiver.webhook()) == 1, 60, "the first incident delivered")
    wait_for(lambda: committed_total(broker, cfg, svc.group) == 1, 30, "the first message committed")

    receiver.down()
    publish(broker, cfg.topic("anomalies"), [anomaly("acme", "train-1", "h2", 5, 1),
                                             anomaly("gamma", "job-9", "h4", 1, 1)])
    wait_for(lambda: svc.stats.post_failures >= 3, 60, "delivery attempts failing while the receiver is down")
    assert committed_total(broker, cfg, svc.group) == 1  # consumed but undelivered: not committed

    receiver.up()
    wait_for(lambda: len(receiver.webhook()) == 3, 90, "the held incidents delivered once the receiver is back")
    wait_for(lambda: committed_total(broker, cfg, svc.group) == 3, 30, "offsets committed after delivery")
    opened = {(h["fleetscope"]["labels"]["tenant"], h["fleetscope"]["labels"]["rank"]) for h in receiver.webhook()}
    assert opened == {("acme", "2"), ("acme", "5"), ("gamma", "1")}
    for alert in receiver.alertmanager():
        check_postable([alert])
    assert svc.stats.bad_records == 0


def test_a_bad_message_is_counted_and_skipped_not_fatal(pipeline_cfg, broker, receiver, run_service):
    receiver.up()
    cfg = pipeline_cfg
    p = Producer({"bootstrap.servers": broker.bootstrap})
    p.produce(cfg.topic("anomalies"), key=b"acme/x", value=b"{not json")
    p.produce(cfg.topic("anomalies"), key=b"acme/x", value=json.dumps({"tenant": "acme"}).encode())
    assert p.flush(30) == 0
    publish(broker, cfg.topic("anomalies"), [anomaly("acme", "train-1", "h1", 2, 0)])
    svc = run_service(alert_resolve_s=3600.0, alert_resend_s=3600.0)
    wait_for(lambda: len(receiver.webhook()) == 1, 60, "the good record delivered")
    assert svc.stats.bad_records == 2
    wait_for(lambda: committed_total(broker, cfg, svc.group) == 3, 30, "all three committed")
