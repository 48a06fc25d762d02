"""Synthetic host batches through a real idempotent producer, counting only what Kafka acknowledged: the chaos
suite's feed (tests/test_chaos.py), also used by the worker's fatal-exit test."""
from __future__ import annotations

import random
import time
from collections import Counter

import numpy as np
from confluent_kafka import Producer

from fleetscope.config import Config
from fleetscope.eval.wire_mutations import mutant, sample_batch
from fleetscope.schema import node_identity
from fleetscope.wire import Batch, StrColumn, encode

SEC = 10**9
NAMES = tuple(f"cpu.{s}" for s in ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"))


def host_batch(host: str, ts_ns: int) -> Batch:
    n = len(NAMES)
    cols = {"ts_ns": np.full(n, ts_ns, dtype="<i8"), **node_identity(host, n),
            "metric": StrColumn(np.arange(n, dtype=np.uint32), NAMES), "device": StrColumn.constant("all", n),
            "value": np.array([0.3, 0, 0.1, 0.6, 0, 0, 0, 0]), "interval_ns": np.full(n, SEC // 2, dtype="<i8")}
    return Batch("host", host, cols)


class Feed:
    """Synthetic host batches through a real idempotent producer; only what Kafka acknowledged counts as sent."""

    def __init__(self, cfg: Config, prefix: str, hosts: int):
        self.cfg, self.topic = cfg, cfg.raw_topic("host")
        self.hosts = [f"{prefix}-{k}" for k in range(hosts)]
        self.producer = Producer({"bootstrap.servers": cfg.kafka, "acks": "all", "enable.idempotence": True,
                                  "linger.ms": 5, "message.timeout.ms": 600_000})
        self.t0 = time.time_ns() // SEC * SEC - 30 * SEC
        self.rounds = 0
        self.sent = self.failed = self.malformed_sent = 0

    def _delivered(self, events: int, malformed: bool = False):
        def cb(err, _msg):
            if err is not None:
                self.failed += events or 1
            elif malformed:
                self.malformed_sent += 1
            else:
                self.sent += events
        return cb

    def round(self) -> None:
        """One 0.5 s tick of event time for every host (the data's pace; not a synchronisation)."""
        ts = self.t0 + self.rounds * SEC // 2
        for k, host in enumerate(self.hosts):
            b = host_batch(host, ts)
            self.producer.produce(self.topic, key=f"_node/{host}".encode(), value=encode(b), headers=b.kafka_headers(),
                                  partition=k % self.cfg.partitions, on_delivery=self._delivered(b.count))
        self.producer.poll(0)
        self.rounds += 1
        time.sleep(0.25)

    def malformed(self, n: int, seed: int = 14) -> Counter:
        rng = random.Random(seed)
        strategies = Counter()
        valid = encode(sample_batch(rng))
        for i in range(n):
            if i % 200 == 0:
                valid = encode(sample_batch(rng))
            strategy, value = mutant(rng, valid)
            strategies[strategy] += 1
            # a key no batch can agree with: even a mutant that still decodes is refused (with its reason)
            while True:
                try:
                    self.producer.produce(self.topic, key=b"chaos/malformed", value=value,
                                          on_delivery=self._delivered(0, malformed=True))
                    break
                except BufferError:
                    self.producer.poll(0.1)
            self.producer.poll(0)
        return strategies

    def finish(self, timeout_s: float = 120) -> None:
        assert self.producer.flush(timeout_s) == 0, "the producer could not deliver everything"
