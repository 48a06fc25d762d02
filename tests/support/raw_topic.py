"""Reading back what an agent or publisher put on a raw topic: decoded batches, in partition order."""
import time

from confluent_kafka import Consumer, TopicPartition

from fleetscope import wire


def read_batches(bootstrap: str, topic: str, partitions: int, want_rows: int, timeout_s: float = 30.0) -> dict:
    """{partition: [decoded batch, ...] in offset order} once at least want_rows rows arrived (or timeout)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "readback", "fetch.wait.max.ms": 10,
                         "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    got: dict = {p: [] for p in range(partitions)}
    rows = 0
    deadline = time.monotonic() + timeout_s
    try:
        while rows < want_rows and time.monotonic() < deadline:
            for m in consumer.consume(100, 0.5):
                if m.error():
                    continue
                batch = wire.decode(m.value(), m.headers())
                got[m.partition()].append(batch)
                rows += batch.count
    finally:
        consumer.close()
    return got
