"""`fleetscope alert` delivery, end to end: the real embedded broker, the real alert service and consumer, and a
real HTTP receiver on loopback (http.server in a thread) standing in for Alertmanager and a webhook, which are
not installed here. Every Alertmanager payload is validated against the `postableAlerts` definition of
Alertmanager's own OpenAPI spec (deploy/schemas/alertmanager-v2-openapi.yaml)."""
from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import replace
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jsonschema
import pytest
import yaml
from confluent_kafka import Consumer, Producer, TopicPartition

from fleetscope.streams.alerting.service import AlertService

SCHEMA = Path(__file__).resolve().parents[1] / "deploy" / "schemas" / "alertmanager-v2-openapi.yaml"


def postable_alerts_validator() -> jsonschema.Validator:
    """The OpenAPI 2 `definitions` as a JSON Schema: `$ref: '#/definitions/x'` resolves inside the document."""
    spec = yaml.safe_load(SCHEMA.read_text())
    schema = {"$ref": "#/definitions/postableAlerts", "definitions": spec["definitions"]}
    return jsonschema.Draft4Validator(schema, format_checker=jsonschema.FormatChecker())


VALIDATOR = postable_alerts_validator()


def check_postable(body) -> None:
    VALIDATOR.validate(body)
    for alert in body:  # the format checker skips date-time without an extra package: check RFC 3339 here
        for key in ("startsAt", "endsAt"):
            if key in alert:
                assert alert[key].endswith("Z") and datetime.fromisoformat(alert[key])


class Receiver:
    """An HTTP receiver on a fixed loopback port that can be taken down and brought back up."""

    def __init__(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.posts: list[tuple[str, object]] = []
        self.lock = threading.Lock()
        self.server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> "Receiver":
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with receiver.lock:
                    receiver.posts.append((self.path, body))
                self.send_response(200)
                self.end_headers()

        ThreadingHTTPServer.allow_reuse_address = True
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def down(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def alertmanager(self) -> list[dict]:
        with self.lock:
            return [a for path, body in self.posts if path == "/api/v2/alerts" for a in body]

    def webhook(self) -> list[dict]:
        with self.lock:
            return [body for path, body in self.posts if path == "/hook"]


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def anomaly(tenant, job, host, rank, window, score=30.0) -> dict:
    return {"tenant": tenant, "job": job, "host": host, "rank": rank, "window_start_ns": 1_700_000_000_000_000_000
            + window * 10**9, "score": score, "threshold": 20.0, "detectors": ["gmm"], "contributions": {},
            "peer_z": {}, "features": {}}


def diagnosis(a: dict, entry: str, confidence: float) -> dict:
    return {**{k: a[k] for k in ("tenant", "job", "host", "rank", "window_start_ns", "score", "threshold")},
            "detectors": ["gmm"], "fingerprint": {}, "fingerprint_unsigned": [], "top_features": [],
            "matches": [{"kb_entry": entry, "confidence": confidence, "similarity": 0.9, "rules_held": [],
                         "evidence": {}}]}


def publish(broker, topic: str, records: list[dict]) -> None:
    p = Producer({"bootstrap.servers": broker.bootstrap})
    for r in records:
        p.produce(topic, key=f"{r['tenant']}/{r['job']}".encode(), value=json.dumps(r).encode())
    assert p.flush(30) == 0


def committed_total(broker, cfg, group: str) -> int:
    c = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": group})
    try:
        parts = [TopicPartition(cfg.topic(t), p) for t in ("anomalies", "diagnoses") for p in range(cfg.partitions)]
        return sum(max(tp.offset, 0) for tp in c.committed(parts, timeout=10))
    finally:
        c.close()


@pytest.fixture()
def receiver():
    r = Receiver()
    yield r
    if r.server is not None:
        try:
            r.down()
        except Exception:
            pass


@pytest.fixture()
def run_service(pipeline_cfg, broker, receiver):
    started = []

    def start(**settings) -> AlertService:
        cfg = replace(pipeline_cfg, alert_alertmanager_url=receiver.url, alert_webhook_url=receiver.url + "/hook",
                      alert_tenant_labels=("acme:team=ml-infra",), **settings)
        svc = AlertService(cfg, broker.bootstrap)
        thread = threading.Thread(target=svc.run, daemon=True)
        thread.start()
        started.append((svc, thread))
        return svc

    yield start
    for svc, thread in started:
        svc.stop()
        thread.join(30)


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
    assert "team" not in [a for a in resolved if a["labels"]["tenant"] == "beta"][0]["labels"]
    assert acme["startsAt"] < acme["endsAt"]
    hooks = receiver.webhook()  # the webhook hears of each incident twice: opened and resolved
    assert sorted((h["fleetscope"]["labels"]["job"], h["fleetscope"]["status"]) for h in hooks) == [
        ("eval-2", "firing"), ("eval-2", "resolved"), ("train-1", "firing"), ("train-1", "resolved")]
    assert all(h["text"] for h in hooks)
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
