"""Reading a topic to its end on the embedded broker (tansu, real), whose reported end stops short of the
last record batch's tail."""
import uuid

from confluent_kafka import Consumer, Producer, TopicPartition

from fleetscope.cli.launcher import EmbeddedStack
from fleetscope.config import Config
from fleetscope.topic_reader import read_to_end, read_topic, true_ends
from fleetscope.topics import ensure_topics


class OneAtATime:
    """A real consumer that hands one message per poll, as librdkafka may when the app polls while a fetched
    batch is still being queued: what a reader sees past the reported end is then up to its next polls."""

    def __init__(self, consumer):
        self.consumer = consumer

    def consume(self, num_messages, timeout):
        return self.consumer.consume(1, timeout)

    def __getattr__(self, name):
        return getattr(self.consumer, name)


def produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50})  # sent together: one record batch
    for v in values:
        p.produce(topic, value=v, partition=0)
    assert p.flush(30) == 0


def a_then_bcd(bootstrap: str, partitions: int = 1) -> str:
    """A new topic holding `a` in one batch, then `b`, `c`, `d` in one more, on partition 0."""
    topic = f"reader-{uuid.uuid4().hex[:6]}"
    ensure_topics(bootstrap, [topic], partitions=partitions)
    produce(bootstrap, topic, [b"a"])
    produce(bootstrap, topic, [b"b", b"c", b"d"])
    return topic


def test_every_message_of_the_last_batch_is_read_though_the_reported_end_is_short(broker):
    topic = a_then_bcd(broker.bootstrap)
    consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": f"g-{uuid.uuid4().hex[:6]}",
                         "enable.auto.commit": False})
    try:
        reported_end = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)[1]
        # why the reader drains: the broker's end covers only the last batch's first record (2, not 4); a
        # reader that stopped there would miss c and d
        assert reported_end <= 4
        got = []
        read_to_end(OneAtATime(consumer), [TopicPartition(topic, 0)], got.append, timeout_s=30)
        assert [m.value() for m in got] == [b"a", b"b", b"c", b"d"]
    finally:
        consumer.close()
    assert [m.value() for m in read_topic(broker.bootstrap, topic)] == [b"a", b"b", b"c", b"d"]


def test_an_empty_topic_reads_as_nothing(broker):
    topic = f"reader-{uuid.uuid4().hex[:6]}"
    ensure_topics(broker.bootstrap, [topic], partitions=2)
    assert read_topic(broker.bootstrap, topic) == []


def test_true_ends_reach_past_the_short_report_on_every_partition_at_once(broker):
    topic = a_then_bcd(broker.bootstrap, partitions=2)
    consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": f"g-{uuid.uuid4().hex[:6]}",
                         "enable.auto.commit": False})
    try:
        ends = true_ends(consumer, [TopicPartition(topic, 0), TopicPartition(topic, 1)])
    finally:
        consumer.close()
    assert ends == {(topic, 0): (0, 4), (topic, 1): (0, 0)}


def test_the_stacks_lag_probe_counts_the_tail_of_the_last_batch(broker, tmp_path):
    """`fleetscope up`'s lag and every drain check read it: 0 must mean every message was committed."""
    topic = a_then_bcd(broker.bootstrap)
    group = f"g-{uuid.uuid4().hex[:6]}"
    committer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": group, "enable.auto.commit": False})
    stack = EmbeddedStack(Config(data_dir=tmp_path, kafka=broker.bootstrap))
    try:
        committer.commit(offsets=[TopicPartition(topic, 0, 2)], asynchronous=False)  # a and b done
        assert stack.lag(group, [topic]) == 2  # the broker's report alone (an end of 2) says 0
        committer.commit(offsets=[TopicPartition(topic, 0, 4)], asynchronous=False)
        assert stack.lag(group, [topic]) == 0
    finally:
        committer.close()
        stack.stop()  # started nothing: closes the probe's consumers
