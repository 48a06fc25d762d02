"""The agent's publisher: one message per (tenant, job), a bounded spool, counted drops."""
import time

import numpy as np
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from fleetscope import wire
from fleetscope.broker import free_port
from fleetscope.config import Config
from fleetscope.topics import all_topics, ensure_topics
from fleetscope.wire import Batch, StrColumn
from fleetscope.producers.agent import agent_stats_batch
from fleetscope.producers.publisher import Publisher, split_by_job


def two_job_batch() -> Batch:
    n = 6
    cols = {"ts_ns": np.arange(n, dtype="<i8"),
            "tenant": StrColumn(np.array([0, 0, 1, 1, 0, 1], dtype=np.uint32), ("acme", "beta")),
            "job": StrColumn(np.array([0, 0, 0, 0, 0, 0], dtype=np.uint32), ("train",)),
            "rank": np.arange(n, dtype="<i4"), "pid": np.zeros(n, dtype="<i4"), "gpu": np.zeros(n, dtype="<i2"),
            "metric": StrColumn.constant("m", n), "device": StrColumn.constant("all", n),
            "value": np.arange(n, dtype="<f8"), "interval_ns": np.zeros(n, dtype="<i8")}
    return Batch("host", "node-a", cols)


def test_a_batch_spanning_two_jobs_becomes_one_message_per_job_key():
    parts = dict(split_by_job(two_job_batch()))
    assert sorted(parts) == ["acme/train", "beta/train"]
    assert parts["acme/train"].columns["rank"].tolist() == [0, 1, 4]
    assert parts["beta/train"].columns["rank"].tolist() == [2, 3, 5]
    assert parts["acme/train"].batch_id != parts["beta/train"].batch_id


def test_publishes_keyed_batches_with_headers_to_the_raw_topic(broker, tmp_path):
    cfg = Config(data_dir=tmp_path, topic_prefix=f"pub{time.time_ns()}", partitions=3, host="node-a")
    ensure_topics(broker.bootstrap, all_topics(cfg), cfg.partitions)
    meta = AdminClient({"bootstrap.servers": broker.bootstrap}).list_topics(timeout=5)
    assert len(meta.topics[cfg.raw_topic("host")].partitions) == 3  # the configured partition count
    pub = Publisher(cfg, broker.bootstrap)
    pub.publish(two_job_batch())
    assert pub.flush(10) == 0
    assert pub.stats.batches_sent == 2 and pub.stats.events_sent == 6
    consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "x", "fetch.wait.max.ms": 10})
    consumer.assign([TopicPartition(cfg.raw_topic("host"), p, 0) for p in range(3)])
    got = []
    deadline = time.monotonic() + 10
    while len(got) < 2 and time.monotonic() < deadline:
        got += [m for m in consumer.consume(10, 0.5) if not m.error()]
    consumer.close()
    keys = sorted(m.key() for m in got)
    assert keys == [b"acme/train", b"beta/train"]
    for m in got:
        batch = wire.decode(m.value(), m.headers())
        assert batch.count == 3 and dict(m.headers())["fs-count"] == b"3"


def test_while_kafka_is_unreachable_the_spool_is_bounded_and_drops_are_counted(tmp_path):
    cfg = Config(data_dir=tmp_path, host="node-a", spool_max_batches=3)
    dead = f"127.0.0.1:{free_port()}"  # nothing listens here
    pub = Publisher(cfg, dead, extra_conf={"queue.buffering.max.messages": 2, "message.timeout.ms": 300})
    batch = agent_stats_batch("node-a", {"x": 1.0, "y": 2.0}, time.time_ns())
    for _ in range(10):
        pub.publish(Batch(batch.source, batch.host, batch.columns))
    deadline = time.monotonic() + 5
    while pub.stats.dropped_batches < 7 and time.monotonic() < deadline:
        pub.retry_spool()
        time.sleep(0.1)
    assert pub.stats.batches_sent == 0
    # 10 batches: 3 fit the spool, 2 may sit in librdkafka's queue; the rest are dropped and counted
    assert pub.stats.dropped_batches >= 5 and pub.stats.dropped_events == 2 * pub.stats.dropped_batches
    assert pub.stats.spooled <= 3
    # and the counters travel as an `agent` batch like any other event
    stats_batch = agent_stats_batch("node-a", {"dropped_events": pub.stats.dropped_events}, time.time_ns())
    assert stats_batch.columns["value"].tolist() == [float(pub.stats.dropped_events)]
