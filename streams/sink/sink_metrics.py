"""`fleetscope sink`'s /metrics: what it stored, what it refused, and whether the store is there.

Served on `metrics_address:sink_metrics_port` (a port of its own: the sink often runs beside a worker and an
agent, which share `metrics_port`); its URL goes to `<data_dir>/metrics-sink.json`.

- rows stored, inserts, failed inserts and insert latency per table: counted at the store's door
  (counted_store.py);
- dead letters the sink made itself (unreadable derived messages, rows the store refused), by reason
  category (dlq_reasons.py);
- the loop's own counters, read from `Sink.snapshot()` when Prometheus scrapes: records taken, duplicates,
  commits, replays of an interrupted poll (poll_plan.py), and the store-unavailable state;
- consumer lag per topic: librdkafka's own `consumer_lag` (high watermark minus committed offset), from the
  statistics it hands the consumer every LAG_STATS_MS on the sink's own thread, inside its polls. Asking the
  consumer from the scrape's thread instead blocks: librdkafka serves assignment() through the group's
  queue, which waits while the sink polls.
"""
from __future__ import annotations

import json
import logging
import threading

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fleetscope.metrics_endpoint import MetricsEndpoint
from fleetscope.streams.dlq_reasons import DeadLetterCounter
from fleetscope.streams.sink.counted_store import CountedStore

log = logging.getLogger(__name__)
LAG_STATS_MS = 5000

COUNTERS = {  # Sink.snapshot() key -> (metric, help)
    "sink_records": ("fleetscope_sink_records", "Kafka records taken (raw and derived topics)"),
    "sink_raw_skipped": ("fleetscope_sink_raw_skipped", "raw records the worker dead-letters, so not stored raw"),
    "sink_duplicate_batches": ("fleetscope_sink_duplicate_batches", "raw batches seen before, not stored again"),
    "sink_unreadable": ("fleetscope_sink_unreadable", "derived records that did not decode (dead-lettered)"),
    "sink_store_rejected": ("fleetscope_sink_store_rejected", "parts the store refused (dead-lettered)"),
    "sink_dlq_rows": ("fleetscope_sink_dlq_rows", "dead letters the sink stored itself"),
    "sink_commits": ("fleetscope_sink_commits", "polls stored and committed"),
    "sink_replayed_polls": ("fleetscope_sink_poll_plan_replays",
                            "interrupted polls replayed from the poll plan after a restart"),
}


class SinkCollector:
    def __init__(self, sink, lag):
        self.sink = sink
        self.lag = lag  # () -> {topic: messages} or None before the first statistics

    def collect(self):
        try:
            snap = self.sink.snapshot()
        except Exception:  # mid-update during a scrape: report the rest
            log.debug("sink snapshot unavailable during this scrape", exc_info=True)
            snap = {}
        for key, (name, doc) in COUNTERS.items():
            if key in snap:
                c = CounterMetricFamily(name, doc)
                c.add_metric([], float(snap[key]))
                yield c
        if "sink_paused" in snap:
            g = GaugeMetricFamily("fleetscope_sink_store_unavailable",
                                  "1 while the store does not take the sink's inserts (partitions paused, retrying)")
            g.add_metric([], 1.0 if snap["sink_paused"] else 0.0)
            yield g
        if "sink_store_down_s" in snap:
            g = GaugeMetricFamily("fleetscope_sink_store_down_seconds",
                                  "seconds the store has been failing (0 while it works)")
            g.add_metric([], float(snap["sink_store_down_s"]))
            yield g
        lag = self.lag()
        if lag is not None:
            g = GaugeMetricFamily("fleetscope_sink_consumer_lag_messages",
                                  "records on the sink's assigned partitions not yet committed, per topic",
                                  labels=["topic"])
            for topic, n in sorted(lag.items()):
                g.add_metric([topic], float(n))
            yield g


class ConsumerLag:
    """Per-topic lag from librdkafka's statistics JSON (`stats_cb`), summed over the partitions it fetches."""

    def __init__(self):
        self.lock = threading.Lock()
        self.latest: dict[str, int] | None = None

    def on_stats(self, doc: str) -> None:
        try:
            topics = json.loads(doc).get("topics", {})
            lag: dict[str, int] = {}
            for topic, t in topics.items():
                for p in t.get("partitions", {}).values():
                    if p.get("partition", -1) < 0 or p.get("fetch_state") == "none":  # not this sink's
                        continue
                    n = p.get("consumer_lag", -1)  # -1 until the partition's first commit
                    if n is None or n < 0:
                        n = 0 if p.get("hi_offset") == 0 else None  # an empty partition lags nothing
                    if n is not None:
                        lag[topic] = lag.get(topic, 0) + int(n)
        except (ValueError, AttributeError, TypeError) as exc:  # a statistics format this code does not know
            log.debug("librdkafka statistics unreadable: %s", exc)
            return
        with self.lock:
            self.latest = lag

    def __call__(self) -> dict[str, int] | None:
        with self.lock:
            return None if self.latest is None else dict(self.latest)


class SinkMetrics:
    """The sink's registry and endpoint. `store` is the store to hand the Sink (counted), `consumer_settings`
    go into its consumer's configuration; `watch` adds the sink's loop once it exists."""

    def __init__(self, cfg, store):
        self.registry = CollectorRegistry()
        self.store = CountedStore(store, self.registry)
        self.dead_letters = DeadLetterCounter(self.registry, "sink")
        self.lag = ConsumerLag()
        self.endpoint = MetricsEndpoint(self.registry, "sink", cfg.metrics_address, cfg.sink_metrics_port,
                                        cfg.data_dir)

    def consumer_settings(self) -> dict:
        """What the sink's Kafka consumer needs for the lag: librdkafka's statistics, handed to this."""
        return {"statistics.interval.ms": LAG_STATS_MS, "stats_cb": self.lag.on_stats}

    def watch(self, sink) -> None:
        self.registry.register(SinkCollector(sink, self.lag))
        writer = sink.writer
        take = writer.dead_letter_insert

        def counted():  # each dead letter is taken here exactly once (a failed insert retries the same rows)
            dead = take()
            if dead is not None:
                for rec in dead[1]:
                    self.dead_letters.count(rec.header("fs-dlq-reason"))
            return dead
        writer.dead_letter_insert = counted

    def start(self) -> "SinkMetrics":
        self.endpoint.start()
        return self

    def stop(self) -> None:
        self.endpoint.stop()
