"""A sink as `fleetscope sink` makes one: its own consumer in the sink group, subscribed to the sink's topics."""
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
