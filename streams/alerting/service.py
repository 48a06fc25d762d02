"""`fleetscope alert`: consume the anomaly and diagnosis topics, deliver incidents, commit after delivery.

Delivery is at least once: the consumer's offsets are committed only once every notification that the
consumed messages caused has reached its receiver. While a receiver is down the service retries with backoff
and consumes nothing more (its partitions are paused, the group membership kept), so a restart re-reads what
was not delivered. Incidents live in memory: after a restart, an incident whose messages were all committed
is not resolved by this process (Alertmanager resolves it on its own once re-posts stop).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass

from fleetscope.kafka_settings import client_conf
from fleetscope.streams.alerting.alertmanager import API_PATH, postable_alert
from fleetscope.streams.alerting.delivery import Backoff, Post, post_json
from fleetscope.streams.alerting.incidents import IncidentBook, Notification, RecordError
from fleetscope.streams.alerting.routing import Routing
from fleetscope.streams.alerting.webhook import webhook_payload

log = logging.getLogger(__name__)
BATCH = 500


@dataclass
class AlertStats:
    consumed: int = 0
    bad_records: int = 0      # undecodable or incomplete messages: logged with the reason, counted, skipped
    incidents_opened: int = 0
    incidents_resolved: int = 0
    posts_delivered: int = 0
    post_failures: int = 0
    commits: int = 0


class AlertService:
    def __init__(self, cfg, bootstrap: str, group: str | None = None, post=post_json):
        self.cfg = cfg
        self.bootstrap = bootstrap
        self.group = group or f"{cfg.consumer_group}-alert"
        self.routing = Routing.from_config(cfg)
        self.book = IncidentBook(cfg.alert_resolve_s, cfg.alert_resend_s)
        self.post = post
        self.stats = AlertStats()
        self.stopping = threading.Event()
        self.topics = {cfg.topic("anomalies"): "anomaly", cfg.topic("diagnoses"): "diagnosis"}

    def stop(self) -> None:
        self.stopping.set()

    # ---- the loop -----------------------------------------------------------------------------------------
    def run(self, duration_s: float | None = None) -> None:
        from confluent_kafka import Consumer
        consumer = Consumer(client_conf(self.cfg, self.bootstrap, **{
            "group.id": self.group, "enable.auto.commit": False, "auto.offset.reset": "earliest",
            "fetch.wait.max.ms": 100}))
        consumer.subscribe(list(self.topics))
        deadline = None if duration_s is None else time.monotonic() + duration_s
        uncommitted = False
        try:
            while not self.stopping.is_set() and (deadline is None or time.monotonic() < deadline):
                msgs = consumer.consume(num_messages=BATCH, timeout=0.2)
                for m in msgs:
                    if m.error():
                        log.warning("alert consumer: %s", m.error())
                        continue
                    self._handle(m.topic(), m.value())
                    uncommitted = True
                # until nothing is due: messages fetched while a delivery waited add notifications of their own
                while notes := self.book.due():
                    if not self._deliver(notes, consumer):
                        return  # stopping with undelivered notifications: nothing more is committed
                if uncommitted:
                    consumer.commit(asynchronous=False)
                    self.stats.commits += 1
                    uncommitted = False
        finally:
            consumer.close()

    def _handle(self, topic: str, value: bytes | None) -> None:
        self.stats.consumed += 1
        kind = self.topics.get(topic)
        try:
            record = json.loads(value or b"")
            if not isinstance(record, dict):
                raise RecordError("alert record is not a JSON object")
            opened = len(self.book.open)
            self.book.observe(record, record.get("matches") if kind == "diagnosis" else None)
            self.stats.incidents_opened += max(0, len(self.book.open) - opened)
        except (ValueError, RecordError) as exc:  # json's errors are ValueErrors
            self.stats.bad_records += 1
            log.warning("skipped a message on %s: %s", topic, exc)

    # ---- delivery -----------------------------------------------------------------------------------------
    def posts_for(self, notes: list[Notification]) -> list[Post]:
        posts: list[Post] = []
        am_alerts = []
        for n in notes:
            inc = n.incident
            routing_labels = self.routing.labels(inc.key.tenant)
            what = f"{inc.key.tenant}/{inc.key.job} rank {inc.key.rank} on {inc.key.host} {n.kind}"
            if self.routing.alertmanager_url:
                am_alerts.append(postable_alert(inc, routing_labels))
            hook = self.routing.webhook(inc.key.tenant)
            if hook and n.kind in ("open", "resolve"):  # chat receivers hear of an incident twice, not every minute
                posts.append(Post(hook, webhook_payload(inc, routing_labels), f"webhook {what}"))
        if am_alerts:
            posts.insert(0, Post(self.routing.alertmanager_url.rstrip("/") + API_PATH, am_alerts,
                                 f"alertmanager {len(am_alerts)} alerts"))
        return posts

    def _deliver(self, notes: list[Notification], consumer) -> bool:
        """Deliver every post these notifications need; False if asked to stop before all were delivered."""
        if not notes:
            return True
        pending = self.posts_for(notes)
        backoff = Backoff()
        paused = False
        try:
            while pending:
                failed = []
                for p in pending:
                    reason = self.post(p)
                    if reason is None:
                        self.stats.posts_delivered += 1
                    else:
                        self.stats.post_failures += 1
                        failed.append(p)
                        log.warning("alert delivery failed (%s): %s; retrying", p.what, reason)
                pending = failed
                if pending:
                    if not paused:
                        consumer.pause(consumer.assignment())
                        paused = True
                    if self._sleep(backoff.wait_s(), consumer):
                        return False
        finally:
            if paused:
                consumer.resume(consumer.assignment())
        self.book.mark_sent(notes)
        self.stats.incidents_resolved += sum(1 for n in notes if n.kind == "resolve")
        return True

    def _sleep(self, seconds: float, consumer) -> bool:
        """Wait while keeping the group membership; True if asked to stop."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.stopping.is_set():
                return True
            msg = consumer.poll(min(0.2, max(0.0, end - time.monotonic())))  # paused: serves the group only
            if msg is not None and not msg.error():
                # a message fetched before the pause: keep it, it is handled (and committed) after delivery
                self._handle(msg.topic(), msg.value())
        return self.stopping.is_set()
