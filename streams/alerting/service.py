"""`fleetscope alert`: consume the anomaly and diagnosis topics, deliver incidents, commit after delivery.

Delivery is at least once: the consumer's offsets are committed only once every notification that the
consumed messages caused has reached its receiver. While a receiver is down the service retries with backoff
and consumes nothing more (its partitions are paused, the group membership kept), so a restart re-reads what
was not delivered. The open incidents are saved to a file (incident_file.py) before each commit and loaded at
start, so an incident whose messages were all committed before a restart is still resolved by the new process.
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
from fleetscope.streams.alerting.incident_file import IncidentFile, default_path
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
    incidents_restored: int = 0  # loaded from the state file at start
    state_save_failures: int = 0  # the state file could not be written: nothing was committed until it was
    incidents_over_limit: int = 0  # windows that would have opened an incident past the book's max_open


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
        self.state = IncidentFile(cfg.alert_state_file or default_path(cfg.data_dir, self.group))
        self.saved_changes = self.book.changes

    def stop(self) -> None:
        self.stopping.set()

    # ---- the loop -----------------------------------------------------------------------------------------
    def run(self, duration_s: float | None = None) -> None:
        from confluent_kafka import Consumer
        consumer = Consumer(client_conf(self.cfg, self.bootstrap, **{
            "group.id": self.group, "enable.auto.commit": False, "auto.offset.reset": "earliest",
            "fetch.wait.max.ms": 100}))
        self.stats.incidents_restored = self.state.load(self.book)
        self.saved_changes = self.book.changes
        if self.stats.incidents_restored:
            log.info("restored %d open incidents from %s", self.stats.incidents_restored, self.state.path)
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
                if not self._deliver_and_save(consumer, uncommitted):
                    return  # stopping with undelivered notifications or unsaved state: nothing more is committed
                if uncommitted:
                    consumer.commit(asynchronous=False)
                    self.stats.commits += 1
                    uncommitted = False
        finally:
            consumer.close()

    def _deliver_and_save(self, consumer, uncommitted: bool) -> bool:
        """Deliver everything due, then save the open incidents; False if asked to stop before both were done.

        The order is delivery, then the state file, then (in run) the offsets' commit:
        - the file is written after delivery, so it holds only incidents whose open reached the receivers (a
          restored incident sends no open of its own), and never lacks one whose resolve is still undelivered;
        - it is written before the commit, because committed messages are never read again: were the commit
          first, a kill between the two would leave an incident firing at the receivers that no process knows.
          A kill after the save and before the commit re-reads those messages into the restored incidents,
          whose windows are already counted; a kill before the save re-reads them and re-opens the incident
          under the same labels (at least once, as before).
        """
        backoff = Backoff()
        while True:
            # until nothing is due: messages fetched while a delivery waited add notifications of their own
            while notes := self.book.due():
                if not self._deliver(notes, consumer):
                    return False
            if not uncommitted and self.book.changes == self.saved_changes:
                return True
            changes = self.book.changes
            try:
                self.state.save(self.book)
            except OSError as exc:
                self.stats.state_save_failures += 1
                log.warning("could not write the alert state %s (%s): committing nothing until it is written; "
                            "free space or set alert_state_file to a writable path", self.state.path, exc)
            else:
                self.saved_changes = changes
                return True
            consumer.pause(consumer.assignment())
            try:
                if self._sleep(backoff.wait_s(), consumer):
                    return False
            finally:
                consumer.resume(consumer.assignment())

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
            if self.book.over_limit != self.stats.incidents_over_limit:
                if not self.stats.incidents_over_limit:
                    log.warning("%d incidents are open, the most the alert service keeps; windows that would "
                                "open more are counted (incidents_over_limit), not alerted", self.book.max_open)
                self.stats.incidents_over_limit = self.book.over_limit
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
