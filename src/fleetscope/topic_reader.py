"""Reading topics to their end, on any Kafka-protocol broker.

A partition's end is its high watermark. tansu, the embedded broker, reports
it as the first offset of the partition's last record batch + 1 (measured:
two records produced at once at offsets 1 and 2 give an end of 2; three at
3..5 give 4). A reader that stops at the reported end can miss the rest of
that last batch. So readers here go to the reported end, then go on taking
what comes until a poll stays empty for `settle_s`. On a broker that reports
the true end, that costs one empty poll.
"""
from __future__ import annotations

import time
from typing import Callable

from confluent_kafka import Consumer, TopicPartition


class ReadTimeout(RuntimeError):
    pass


def drain(consumer, on_message: Callable, settle_s: float, deadline: float) -> int:
    """Hand `on_message` every message that comes until a poll of `settle_s` brings none; the count."""
    taken = 0
    while True:
        if time.monotonic() > deadline:
            raise ReadTimeout("messages kept coming past the deadline")
        batch = consumer.consume(1000, settle_s)
        if not batch:
            return taken
        for msg in batch:
            if msg.error() is None:
                on_message(msg)
                taken += 1


def true_ends(consumer, tps: list[TopicPartition], settle_s: float = 0.1, timeout_s: float = 5.0) -> dict:
    """Each partition's (low, end) where end is one past its last record, not the broker's short report.

    The last record batch starts at the reported end - 1; reading from there shows where it really ends. One
    read covers every partition, waiting up to `settle_s` a poll until each has given a record, then taking
    only what the client already holds (the rest of those batches): a partition that keeps growing is not
    followed, so a probe of a busy topic costs one fetch, and its end is that moment's. `consumer` is assigned
    (never subscribed): it joins no group."""
    deadline = time.monotonic() + timeout_s
    reported = {(tp.topic, tp.partition): consumer.get_watermark_offsets(tp, timeout=timeout_s) for tp in tps}
    ends = {key: high for key, (_low, high) in reported.items()}
    last_batches = [TopicPartition(t, p, high - 1) for (t, p), high in ends.items() if high > 0]
    if last_batches:
        seen: set[tuple[str, int]] = set()
        consumer.assign(last_batches)
        try:
            while time.monotonic() < deadline:
                batch = consumer.consume(1000, settle_s if len(seen) < len(last_batches) else 0)
                if not batch:
                    break
                for msg in batch:
                    if msg.error() is None:
                        key = (msg.topic(), msg.partition())
                        seen.add(key)
                        ends[key] = max(ends[key], msg.offset() + 1)
        finally:
            consumer.unassign()
    return {key: (reported[key][0], end) for key, end in ends.items()}


def committed_and_ends(group_consumer, end_reader, tps: list[TopicPartition], timeout_s: float = 2.0) -> list:
    """Per partition, (partition, the group's committed offset, low, true end): what a lag probe compares.
    `group_consumer` only reads the group's commits (it never joins it); `end_reader` reads the ends."""
    ends = true_ends(end_reader, tps, timeout_s=timeout_s)
    return [(tp.partition, tp.offset, *ends[(tp.topic, tp.partition)])
            for tp in group_consumer.committed(tps, timeout=timeout_s)]


def read_to_end(consumer, tps: list[TopicPartition], on_message: Callable, timeout_s: float = 30.0,
                settle_s: float = 0.5) -> None:
    """Assign `tps` from their first offset and hand `on_message` every message up to the end (see above)."""
    deadline = time.monotonic() + timeout_s
    ends = {(tp.topic, tp.partition): consumer.get_watermark_offsets(tp, timeout=timeout_s)[1] for tp in tps}
    reached = {key: 0 for key in ends}
    consumer.assign([TopicPartition(t, p, 0) for t, p in ends])
    while any(reached[k] < end for k, end in ends.items()):
        if time.monotonic() > deadline:
            behind = {f"{t}/{p}": end - reached[(t, p)] for (t, p), end in ends.items() if reached[(t, p)] < end}
            raise ReadTimeout(f"reading to the end took over {timeout_s:.0f} s; messages behind: {behind}")
        for msg in consumer.consume(1000, 0.2):
            if msg.error() is None:
                reached[(msg.topic(), msg.partition())] = msg.offset() + 1
                on_message(msg)
    drain(consumer, on_message, settle_s, deadline)


def read_topic(bootstrap: str, topic: str, partitions: int | None = None, timeout_s: float = 30.0) -> list:
    """Every message of `topic` (all its partitions), partition by partition in offset order."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"fleetscope-read-{time.time_ns()}",
                         "enable.auto.commit": False, "fetch.wait.max.ms": 10})
    try:
        if partitions is None:
            partitions = len(consumer.list_topics(topic, timeout=timeout_s).topics[topic].partitions)
        out: list = []
        read_to_end(consumer, [TopicPartition(topic, p) for p in range(partitions)], out.append, timeout_s)
        return sorted(out, key=lambda m: (m.partition(), m.offset()))
    finally:
        consumer.close()
