"""The agent's publisher: one message per (tenant, job), a bounded spool, counted drops."""
import os
import time

import numpy as np
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from fleetscope import wire
from fleetscope.broker import free_port
from fleetscope.config import Config
from fleetscope.topics import all_topics, ensure_topics
from fleetscope.schema import node_identity
from fleetscope.wire import Batch, StrColumn
from fleetscope.producers.agent import agent_stats_batch
from fleetscope.producers.publisher import Publisher, split_by_job
from support.raw_topic import read_batches


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
    pub.close(0)  # else its librdkafka client dials the dead address for the rest of the run


def wide_batch(rows: int, seed: int = 0) -> Batch:
    """Random floats: zstd cannot shrink them, so the encoded size grows with the rows (~8 bytes each)."""
    cols = {"ts_ns": np.arange(rows, dtype="<i8"), **node_identity("node-a", rows),
            "metric": StrColumn.constant("m", rows), "device": StrColumn.constant("all", rows),
            "value": np.random.default_rng(seed).random(rows), "interval_ns": np.zeros(rows, dtype="<i8")}
    return Batch("host", "node-a", cols)


def test_a_batch_over_the_message_size_is_split_and_every_row_arrives(broker, tmp_path):
    cfg = Config(data_dir=tmp_path, topic_prefix=f"big{time.time_ns()}", partitions=1, host="node-a")
    ensure_topics(broker.bootstrap, all_topics(cfg), cfg.partitions)
    batch = wide_batch(200_000)  # ~2 MB encoded, twice Kafka's default message.max.bytes
    assert len(wire.encode(batch)) > cfg.kafka_message_max_bytes
    pub = Publisher(cfg, broker.bootstrap)
    pub.publish(batch)  # before: KafkaException MSG_SIZE_TOO_LARGE out of publish, and out of agent.run
    assert pub.flush(30) == 0
    assert pub.stats.split_batches == 1 and pub.stats.dropped_events == 0
    got = read_batches(broker.bootstrap, cfg.raw_topic("host"), 1, want_rows=200_000)[0]
    assert len(got) >= 2
    assert np.concatenate([b.columns["ts_ns"] for b in got]).tolist() == list(range(200_000))  # all, in order


def test_a_single_row_over_the_message_size_is_dropped_and_counted_and_publishing_goes_on(broker, tmp_path):
    cfg = Config(data_dir=tmp_path, topic_prefix=f"row{time.time_ns()}", partitions=1, host="node-a",
                 kafka_message_max_bytes=20_000)
    ensure_topics(broker.bootstrap, all_topics(cfg), cfg.partitions)
    huge = wide_batch(3)
    names = (os.urandom(40_000).hex(), "ok", "ok2")  # one row's metric name alone is over the limit, compressed
    huge.columns["metric"] = StrColumn(np.array([0, 1, 2], dtype=np.uint32), names)
    pub = Publisher(cfg, broker.bootstrap)
    pub.publish(huge)
    pub.publish(wide_batch(10, seed=1))
    assert pub.flush(20) == 0
    assert pub.stats.dropped_oversize_rows == 1 and pub.stats.dropped_events == 1
    got = read_batches(broker.bootstrap, cfg.raw_topic("host"), 1, want_rows=12)[0]
    assert sum(b.count for b in got) == 12  # the other two rows of the huge batch, and the next batch


def test_a_permanently_refused_batch_is_dropped_after_bounded_retries(broker, tmp_path):
    # the topic does not exist and the broker may not create it: UNKNOWN_TOPIC_OR_PART, not an outage
    cfg = Config(data_dir=tmp_path, topic_prefix=f"gone{time.time_ns()}", host="node-a", delivery_max_retries=2)
    pub = Publisher(cfg, broker.bootstrap, extra_conf={"topic.metadata.propagation.max.ms": 200,
                                                       "allow.auto.create.topics": False})
    pub.publish(two_job_batch())
    deadline = time.monotonic() + 60
    while pub.held() and time.monotonic() < deadline:  # before: back into the spool on every tick, forever
        pub.retry_spool()
        time.sleep(0.05)
    assert pub.held() == 0
    assert pub.stats.dropped_permanent_batches == 2 and pub.stats.dropped_events == 6  # two job keys, 3 rows each
    assert pub.stats.refusals == 2 * 3  # each message tried 1 + delivery_max_retries times
