"""A real HTTP receiver on loopback standing in for Alertmanager and a webhook (neither is installed here), the
Alertmanager v2 `postableAlerts` check, and the anomaly and diagnosis messages the alert tests publish."""
from __future__ import annotations

import json
import socket
import threading
from contextlib import contextmanager
from dataclasses import replace
import time
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jsonschema
import pytest
import yaml
from confluent_kafka import Consumer, Producer, TopicPartition

SCHEMA = Path(__file__).resolve().parents[2] / "deploy" / "schemas" / "alertmanager-v2-openapi.yaml"


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


@pytest.fixture()
def receiver():
    """A loopback receiver, taken down at the end if the test left it up."""
    r = Receiver()
    yield r
    if r.server is not None:
        try:
            r.down()
        except Exception:
            pass


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


@contextmanager
def alert_services(pipeline_cfg, broker, receiver, **defaults):
    """start(**settings) runs an AlertService on a thread, posting to `receiver`; all are stopped at the end."""
    from fleetscope.streams.alerting.service import AlertService
    started = []

    def start(**settings):
        cfg = replace(pipeline_cfg, alert_alertmanager_url=receiver.url, alert_webhook_url=receiver.url + "/hook",
                      **{**defaults, **settings})
        svc = AlertService(cfg, broker.bootstrap)
        thread = threading.Thread(target=svc.run, daemon=True)
        thread.start()
        started.append((svc, thread))
        return svc

    try:
        yield start
    finally:
        for svc, thread in started:
            svc.stop()
            thread.join(30)
