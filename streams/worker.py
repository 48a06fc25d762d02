"""`fleetscope streams`: one stream worker against a configured Kafka.

It computes and publishes; it never opens the store (sinks do), so any number
of workers share the consumer group, also beside the embedded chDB. Its jobs'
models and window marks are read back from <prefix>.model-state. Its counters
go to <data_dir>/workers/<pid>.json every second (stats_file.py) and to /metrics.
"""
from __future__ import annotations

import logging

from fleetscope.config import Config
from fleetscope.kafka_settings import client_conf, output_producer_conf, release_producer
from fleetscope.topics import MODEL_STATE, prepare_topics
from fleetscope.streams.app import create_app, run_worker
from fleetscope.streams.processor import StreamProcessor
from fleetscope.streams.state_sources import ModelStateTopic
from fleetscope.streams.stats_file import StatsFile

log = logging.getLogger(__name__)


def derived_producer(cfg: Config, bootstrap: str):
    from confluent_kafka import Producer
    return Producer(output_producer_conf(cfg, bootstrap, "fleetscope-streams", **{"linger.ms": 5}))


def state_reader(cfg: Config, bootstrap: str) -> ModelStateTopic:
    return ModelStateTopic(client_conf(cfg, bootstrap, **{"group.id": f"{cfg.consumer_group}-state-reader"}),
                           cfg.topic(MODEL_STATE))


def run_streams(cfg: Config, bootstrap: str) -> None:
    prepare_topics(cfg, bootstrap)
    states = state_reader(cfg, bootstrap)
    processor = StreamProcessor(cfg, producer=derived_producer(cfg, bootstrap), states=states)
    from fleetscope.streams.worker_metrics import WorkerMetrics
    metrics = WorkerMetrics(cfg, bootstrap, processor).start()  # /metrics (metrics_address:metrics_port)
    stats_file = StatsFile(cfg.data_dir, processor.snapshot).start()
    try:
        run_worker(create_app(cfg, bootstrap, processor))
    except SystemExit:
        if processor.fatal_error is not None:  # stopped itself: say why, and exit non-zero to be restarted
            raise SystemExit(f"fleetscope streams: {processor.fatal_error}") from None
        raise
    finally:
        if processor.scorer is not None:
            try:  # a restarted worker resumes each job's model from here
                processor.close()
            except Exception:
                log.exception("final model checkpoint failed; the last periodic one stands")
        release_producer(processor.producer)
        stats_file.stop()
        metrics.stop()
        states.close()
