"""`fleetscope streams`: one stream worker against a configured Kafka.

It owns the store (chDB is one process per data directory), so it also
serves the loopback endpoint that `fleetscope query` and `fleetscope up`'s
status line use while it runs.
"""
from __future__ import annotations

import logging

from fleetscope.config import Config
from fleetscope.store import open_store
from fleetscope.store.endpoint import QueryEndpoint
from fleetscope.kafka_settings import client_conf
from fleetscope.topics import prepare_topics
from fleetscope.streams.app import create_app, run_worker
from fleetscope.streams.processor import StreamProcessor

log = logging.getLogger(__name__)


def derived_producer(cfg: Config, bootstrap: str):
    from confluent_kafka import Producer
    return Producer(client_conf(cfg, bootstrap, **{"acks": "all", "enable.idempotence": True,
                                                    "linger.ms": 5, "client.id": "fleetscope-streams"}))


def run_streams(cfg: Config, bootstrap: str) -> None:
    prepare_topics(cfg, bootstrap)
    store = open_store(cfg.data_dir, cfg.database, cfg.clickhouse_url, cfg.ttl_days, prefer_endpoint=False)
    applied = store.migrate()
    if applied:
        log.info("applied migrations: %s", ", ".join(applied))
    processor = StreamProcessor(cfg, store, derived_producer(cfg, bootstrap))
    endpoint = QueryEndpoint(store, cfg.data_dir, stats_provider=processor.snapshot)
    endpoint.start()
    from fleetscope.streams.worker_metrics import WorkerMetrics
    metrics = WorkerMetrics(cfg, bootstrap, processor).start()  # /metrics (metrics_address:metrics_port)
    try:
        run_worker(create_app(cfg, bootstrap, processor))
    finally:
        if processor.scorer is not None:
            try:  # a restarted worker resumes each job's model from here
                processor.close()
            except Exception:
                log.exception("final model checkpoint failed; the last periodic one stands")
        metrics.stop()
        endpoint.stop()
        store.close()
