"""A sink as `fleetscope sink` makes one: its own consumer in the sink group, subscribed to the sink's topics."""
import time

import pytest
from confluent_kafka import Consumer

from fleetscope.kafka_settings import client_conf
from fleetscope.streams.sink.consumer import Sink, sink_topics


def subscribed_sink(cfg, store, bootstrap: str, **settings) -> Sink:
    """settings go to Sink (poll_records=, max_rows=, ...); quick group timeouts, so a test's rebalances are short."""
    consumer = Consumer(client_conf(cfg, bootstrap, **{
        "group.id": f"{cfg.consumer_group}-sink", "enable.auto.commit": False, "auto.offset.reset": "earliest",
        "fetch.wait.max.ms": 10, "session.timeout.ms": 6000, "heartbeat.interval.ms": 500}))
    sink = Sink(cfg, store, consumer, **settings)
    consumer.subscribe(sink_topics(cfg), on_assign=sink.on_assign)
    return sink


class KilledBeforeCommit(BaseException):
    """Where a SIGKILL between the store's answer and Kafka's commit leaves the sink: rows stored, offsets not."""


def store_then_die_before_commit(sink: Sink, timeout_s: float = 60.0) -> None:
    """Run the sink until its first poll is stored, then let it die before that poll's commit."""
    def killed_commit(offsets):
        raise KilledBeforeCommit()
    sink._commit = killed_commit
    deadline = time.monotonic() + timeout_s
    with pytest.raises(KilledBeforeCommit):
        while time.monotonic() < deadline:
            sink.step(0.5)
    sink.consumer.close()  # gone without committing
