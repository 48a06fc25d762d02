"""`fleetscope sink`: one sink process. It owns the store (chDB allows one process per data
directory), applies the migrations, and serves the loopback endpoint that `fleetscope query` and
`fleetscope up`'s status line use, and /metrics on `metrics_address:sink_metrics_port` (sink_metrics.py).
Any number of sinks share the group `<consumer_group>-sink` against a ClickHouse server; on the embedded
chDB, one."""
from __future__ import annotations

import logging
import signal
import threading

from fleetscope.kafka_settings import client_conf, output_producer_conf
from fleetscope.store import open_store
from fleetscope.store.endpoint import QueryEndpoint
from fleetscope.topics import RAW_SOURCES, prepare_topics
from fleetscope.streams.sink.consumer import POLL_RECORDS, Sink, sink_topics
from fleetscope.streams.sink.sink_metrics import SinkMetrics

log = logging.getLogger(__name__)


def subscribed_topics(cfg, raw: bool = True) -> list[str]:
    """The sink's topics; without the raw ones (`--no-raw`) where ClickHouse's Kafka engine stores them
    (sql/kafka_engine/), so that no raw row is stored twice."""
    raw_topics = {cfg.raw_topic(s) for s in RAW_SOURCES}
    return [t for t in sink_topics(cfg) if raw or t not in raw_topics]


def run_sink(cfg, bootstrap: str, stop: threading.Event | None = None, raw: bool = True) -> None:
    from confluent_kafka import Consumer, Producer
    prepare_topics(cfg, bootstrap)
    store = open_store(cfg.data_dir, cfg.database, cfg.clickhouse_url, cfg.ttl_days, prefer_endpoint=False)
    applied = store.migrate()
    if applied:
        log.info("applied migrations: %s", ", ".join(applied))
    metrics = SinkMetrics(cfg, store)  # the sink writes through metrics.store, which counts each insert
    consumer = Consumer(client_conf(cfg, bootstrap, **{
        "group.id": f"{cfg.consumer_group}-sink", "enable.auto.commit": False, "auto.offset.reset": "earliest",
        "fetch.wait.max.ms": 50, "queued.max.messages.kbytes": 65536, "session.timeout.ms": 6000,
        "heartbeat.interval.ms": 1000, "client.id": "fleetscope-sink", **metrics.consumer_settings()}))
    producer = Producer(output_producer_conf(cfg, bootstrap, "fleetscope-sink"))
    sink = Sink(cfg, metrics.store, consumer, producer, poll_records=POLL_RECORDS)
    metrics.watch(sink)
    consumer.subscribe(subscribed_topics(cfg, raw), on_assign=sink.on_assign)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    endpoint = QueryEndpoint(store, cfg.data_dir, stats_provider=sink.snapshot)
    endpoint.start()
    metrics.start()
    try:
        sink.run(stop)
    finally:
        metrics.stop()
        endpoint.stop()
        consumer.close()
        store.close()
