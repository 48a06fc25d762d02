"""The worker's /metrics: its own health, and the results (scores, anomalies, diagnoses) of the jobs it sees.

- Self-metrics are read from the processor's snapshot when Prometheus scrapes (the same numbers as the query
  endpoint's /stats), so the data path is untouched; the flush latency histogram times each flush, and dead
  letters are counted by reason category (dlq_reasons.py) as the flush publishes them.
- Results come from the worker's own output topics, read by a consumer of their own group
  (`<consumer_group>-metrics`): with several workers each exports the jobs of the partitions it is given, so a
  job's series come from one worker. One gauge per (job, rank) holds the latest score and threshold, labelled
  tenant, job, host, rank and the latest window's role (streams/model/roles.py: culprit, waiting, node, job; `none`
  when it was not flagged); counters count anomalies per job and role (the anomalies topic carries no waiting
  rank) and diagnoses per KB entry. A job's series
  are removed once it has been idle for metrics_job_expire_s, so cardinality follows the live jobs.
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fleetscope import wire
from fleetscope.kafka_settings import client_conf
from fleetscope.metrics_endpoint import JobSeries, MetricsEndpoint
from fleetscope.streams.dlq_reasons import DeadLetterCounter

log = logging.getLogger(__name__)

COUNTERS = {
    "messages_in": "raw messages consumed", "events_in": "raw events decoded",
    "dlq": "messages and rows sent to the dead-letter queue", "duplicate_batches": "re-delivered batches skipped",
    "windows_out": "windows closed and emitted", "flushes": "flushes to the store",
    "store_errors": "store operations that failed", "publish_errors": "derived messages Kafka refused",
    "store_rejected": "batches or rows the store refused (sent to the DLQ)",
    "late_events": "events later than the allowed lateness", "evicted_keys": "idle window keys evicted",
    "model_scored": "rank-windows scored", "model_anomalies": "rank-windows flagged",
    "model_diagnoses": "diagnoses made", "model_checkpoints": "model checkpoints written",
    "partition_end_unknown": "messages handled without their partition's end offset (idle closing cannot see a backlog)",
}
GAUGES = {
    "open_windows": "windows open", "waiting_windows": "closed windows waiting for their job's step",
    "unacked_messages": "consumed messages not yet acknowledged", "keys": "window keys held",
    "held_acks": "released messages whose acknowledgement waits for an earlier message of their partition",
    "store_down_s": "seconds the store has been failing (0 while it works)",
    "partitions_behind": "raw partitions with messages after the last one handled (their keys do not close as idle)",
}
ROLE_NONE = "none"  # the role label of a rank whose latest window was not flagged
ROLE_UNSAID = "culprit"  # an anomaly from a worker that wrote no role: the rank's own flag, as incidents.py reads it


class WorkerCollector:
    def __init__(self, processor, clock_ns=time.time_ns):
        self.processor = processor
        self.clock_ns = clock_ns

    def collect(self):
        try:
            snap = self.processor.snapshot()
        except Exception:  # mid-update during a scrape: report nothing this time rather than fail the scrape
            log.debug("worker snapshot unavailable during this scrape", exc_info=True)
            return
        for key, doc in COUNTERS.items():
            if key in snap:
                c = CounterMetricFamily(f"fleetscope_worker_{key}", doc)
                c.add_metric([], float(snap[key]))
                yield c
        for key, doc in GAUGES.items():
            if key in snap:
                g = GaugeMetricFamily(f"fleetscope_worker_{key}", doc)
                g.add_metric([], float(snap[key]))
                yield g
        last = snap.get("last_window_end_ns", 0)
        if last:
            lag = GaugeMetricFamily("fleetscope_worker_event_time_lag_seconds",
                                    "wall time minus the end of the newest window emitted")
            lag.add_metric([], max(0.0, (self.clock_ns() - last) / 1e9))
            yield lag


class ResultMetrics:
    """Results of the jobs in the output topics, as bounded labelled series."""

    def __init__(self, registry: CollectorRegistry, expire_s: float):
        rank_labels = ["tenant", "job", "host", "rank", "role"]
        self.score = Gauge("fleetscope_rank_score", "the latest window score of a rank (negative log-likelihood)",
                           rank_labels, registry=registry)
        self.threshold = Gauge("fleetscope_rank_threshold", "the threshold in force for the latest window "
                               "(NaN while the job's model warms up)", rank_labels, registry=registry)
        self.anomalies = Counter("fleetscope_anomalies", "flagged rank-windows on the anomalies topic, by role",
                                 ["tenant", "job", "role"], registry=registry)
        self.diagnoses = Counter("fleetscope_diagnoses", "diagnoses by knowledge-base entry ('unmatched' included)",
                                 ["tenant", "job", "kb_entry"], registry=registry)
        self.bad_messages = Counter("fleetscope_result_metrics_bad_messages",
                                    "output messages the metrics reader could not decode", registry=registry)
        self.series = JobSeries(expire_s)
        self.roles: dict[tuple[str, str, str, str], str] = {}
        self.lock = threading.Lock()

    def scores(self, batch) -> None:
        c = batch.columns
        tenants, jobs, hosts = (c[k].to_numpy() for k in ("tenant", "job", "host"))
        roles = c["role"].to_numpy() if "role" in c else None  # a worker before roles: none
        with self.lock:
            for i in range(batch.count):
                t, j, h, r = str(tenants[i]), str(jobs[i]), str(hosts[i]), str(int(c["rank"][i]))
                role = (str(roles[i]) if roles is not None else "") or ROLE_NONE
                old = self.roles.get((t, j, h, r))
                if old is not None and old != role:
                    for metric in (self.score, self.threshold):
                        self.series.forget(t, j, metric, (t, j, h, r, old))
                self.roles[(t, j, h, r)] = role
                labels = (t, j, h, r, role)
                self.score.labels(*labels).set(float(c["score"][i]))
                threshold = float(c["threshold"][i])
                self.threshold.labels(*labels).set(threshold if not math.isinf(threshold) else math.nan)
                for metric in (self.score, self.threshold):
                    self.series.touch(t, j, metric, labels)

    def anomaly(self, record: dict) -> None:
        t, j, role = str(record["tenant"]), str(record["job"]), str(record.get("role") or ROLE_UNSAID)
        with self.lock:
            self.anomalies.labels(t, j, role).inc()
            self.series.touch(t, j, self.anomalies, (t, j, role))

    def diagnosis(self, record: dict) -> None:
        t, j = str(record["tenant"]), str(record["job"])
        with self.lock:
            for m in record.get("matches") or ():
                labels = (t, j, str(m["kb_entry"]))
                self.diagnoses.labels(*labels).inc()
                self.series.touch(t, j, self.diagnoses, labels)

    def expire(self) -> int:
        with self.lock:
            gone = self.series.expire()
            live = set(self.series.last)
            self.roles = {k: v for k, v in self.roles.items() if k[:2] in live}
            return gone


class ResultReader(threading.Thread):
    """Reads the worker's output topics into ResultMetrics (no delivery guarantee needed: these are gauges)."""

    def __init__(self, cfg, bootstrap: str, results: ResultMetrics):
        super().__init__(name="result-metrics", daemon=True)
        self.cfg, self.bootstrap, self.results = cfg, bootstrap, results
        self.stopping = threading.Event()
        self.handlers = {cfg.topic("scores"): self._scores, cfg.topic("anomalies"): self.results.anomaly,
                         cfg.topic("diagnoses"): self.results.diagnosis}

    def _scores(self, value) -> None:
        self.results.scores(wire.decode(value))

    def _json(self, handler, value) -> None:
        record = json.loads(value)
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
        handler(record)

    def run(self) -> None:
        from confluent_kafka import Consumer
        consumer = Consumer(client_conf(self.cfg, self.bootstrap, **{
            "group.id": f"{self.cfg.consumer_group}-metrics", "auto.offset.reset": "latest",
            "enable.auto.commit": True, "fetch.wait.max.ms": 200}))
        consumer.subscribe(list(self.handlers))
        next_expiry = time.monotonic()
        try:
            while not self.stopping.is_set():
                for m in consumer.consume(num_messages=500, timeout=0.5):
                    if m.error():
                        continue
                    handler = self.handlers.get(m.topic())
                    try:
                        if handler == self._scores:
                            handler(m.value())
                        else:
                            self._json(handler, m.value())
                    except (wire.WireError, ValueError, KeyError, TypeError) as exc:
                        self.results.bad_messages.inc()
                        log.warning("metrics: skipped a message on %s: %s", m.topic(), exc)
                if time.monotonic() >= next_expiry:
                    self.results.expire()
                    next_expiry = time.monotonic() + min(30.0, self.cfg.metrics_job_expire_s / 4)
        finally:
            consumer.close()

    def stop(self) -> None:
        self.stopping.set()
        self.join(10)


class WorkerMetrics:
    """The worker's registry, endpoint and result reader, started and stopped together."""

    def __init__(self, cfg, bootstrap: str, processor):
        self.registry = CollectorRegistry()
        self.registry.register(WorkerCollector(processor))
        self.flush_seconds = Histogram("fleetscope_worker_flush_seconds", "time one flush takes (store, publish)",
                                       registry=self.registry,
                                       buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        run_flush = processor.run_flush

        def timed_flush(job):  # the flusher calls processor.run_flush; time it where it runs
            with self.flush_seconds.time():
                return run_flush(job)
        processor.run_flush = timed_flush
        self.dead_letters = DeadLetterCounter(self.registry, "worker")
        publish_dead = processor.dead.publish

        def counted_dead(rows, batches=None):  # each dead letter the worker publishes, by reason category
            for _, _, reason in rows:
                self.dead_letters.count(reason)
            return publish_dead(rows, batches)
        processor.dead.publish = counted_dead
        self.results = ResultMetrics(self.registry, cfg.metrics_job_expire_s)
        self.reader = ResultReader(cfg, bootstrap, self.results)
        self.endpoint = MetricsEndpoint.from_config(cfg, self.registry, "worker")

    def start(self) -> "WorkerMetrics":
        self.endpoint.start()
        if self.endpoint.server is not None:
            self.reader.start()
        return self

    def stop(self) -> None:
        if self.reader.is_alive():
            self.reader.stop()
        self.endpoint.stop()
