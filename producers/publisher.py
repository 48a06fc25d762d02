"""Publishes batches to Kafka: idempotent, acks=all, with a bounded spool.

While Kafka is unreachable, batches wait in a local spool of bounded size.
When the spool is full the oldest batch is dropped, and every drop is
counted; the agent publishes these counters as `agent` events, so no loss is
silent.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

from fleetscope import wire
from fleetscope.config import Config
from fleetscope.wire import Batch, StrColumn

log = logging.getLogger(__name__)


@dataclass
class PublisherStats:
    batches_sent: int = 0
    events_sent: int = 0
    delivery_errors: int = 0
    dropped_batches: int = 0
    dropped_events: int = 0
    spooled: int = 0


def split_by_job(batch: Batch) -> list[tuple[str, Batch]]:
    """One message per (tenant, job), so that the key `tenant/job` is exact."""
    tenant, job = batch.columns["tenant"], batch.columns["job"]
    pair = tenant.codes.astype(np.uint64) << np.uint64(32) | job.codes.astype(np.uint64)
    uniq = np.unique(pair)
    if len(uniq) == 1:
        return [(f"{tenant.values[int(uniq[0] >> np.uint64(32))]}/{job.values[int(uniq[0] & np.uint64(0xFFFFFFFF))]}", batch)]
    out = []
    for i, p in enumerate(uniq):
        rows = np.nonzero(pair == p)[0]
        cols = {n: (StrColumn(c.codes[rows], c.values) if isinstance(c, StrColumn) else c[rows])
                for n, c in batch.columns.items()}
        key = f"{tenant.values[int(p >> np.uint64(32))]}/{job.values[int(p & np.uint64(0xFFFFFFFF))]}"
        out.append((key, Batch(batch.source, batch.host, cols, batch_id=f"{batch.batch_id}-{i}",
                               created_ns=batch.created_ns, extras=batch.extras)))
    return out


class Publisher:
    def __init__(self, cfg: Config, bootstrap: str, extra_conf: dict | None = None):
        from confluent_kafka import Producer
        self.cfg = cfg
        self.stats = PublisherStats()
        self._spool: deque = deque()
        self._lock = threading.Lock()
        conf = {"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True,
                "linger.ms": 5, "message.timeout.ms": 30_000, "queue.buffering.max.messages": 100_000,
                "client.id": f"fleetscope-agent-{cfg.host}",
                "log.connection.close": False}  # a broker going away is handled by the spool, not logged
        conf.update(extra_conf or {})
        self._producer = Producer(conf)

    def publish(self, batch: Batch) -> None:
        for key, part in split_by_job(batch):
            value = wire.encode(part)
            self._send((self.cfg.raw_topic(part.source), key.encode(), value, part.kafka_headers(), part.count))
        self._producer.poll(0)

    def _send(self, item) -> None:
        topic, key, value, headers, count = item

        def delivered(err, _msg, item=item):
            with self._lock:
                if err is None:
                    self.stats.batches_sent += 1
                    self.stats.events_sent += count
                else:
                    self.stats.delivery_errors += 1
                    self._spool_add(item)

        try:
            self._producer.produce(topic, value=value, key=key, headers=headers, on_delivery=delivered)
        except BufferError:
            with self._lock:
                self._spool_add(item)

    def _spool_add(self, item) -> None:
        self._spool.append(item)
        while len(self._spool) > self.cfg.spool_max_batches:
            dropped = self._spool.popleft()
            self.stats.dropped_batches += 1
            self.stats.dropped_events += dropped[4]
            log.warning("spool full (%d batches): dropped the oldest batch of %d events",
                        self.cfg.spool_max_batches, dropped[4])
        self.stats.spooled = len(self._spool)

    def retry_spool(self) -> None:
        """Resend what waited in the spool; called on every agent tick."""
        with self._lock:
            pending, self._spool = list(self._spool), deque()
            self.stats.spooled = 0
        for item in pending:
            self._send(item)
        self._producer.poll(0)

    def flush(self, timeout_s: float = 10.0) -> int:
        """Wait for deliveries; returns how many messages are still in flight."""
        self.retry_spool()
        return self._producer.flush(timeout_s)
