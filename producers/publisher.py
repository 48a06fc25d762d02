"""Publishes batches to Kafka: idempotent, acks=all, in order, with a bounded spool.

Everything the agent holds until the broker acknowledges it counts against
one bound, in batches and in bytes: the messages handed to librdkafka (at
most a window of them) and those waiting in the spool behind them. Past the
bound the oldest waiting message is dropped, and every drop is counted; the
agent publishes these counters as `agent` events, so no loss is silent.

Order: messages leave in the order they were published. librdkafka keeps
order within a partition while it retries (idempotence, at most 5 requests
in flight). When messages come back failed (an outage outlasting
message.timeout.ms), sending pauses until every message in flight is back,
and then resumes from the oldest, so a resent batch never lands behind a
newer one and the worker never sees it as late.

What never stops the agent: a batch over the broker's message size is split
to fit (a single row too large is dropped, counted); a message the broker
refuses for good (not an outage) is retried delivery_max_retries times, then
dropped, counted; a fatal producer error replaces the producer, keeping
every message it held.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass

from fleetscope import wire
from fleetscope.config import Config
from fleetscope.kafka_settings import release_producer
from fleetscope.wire import Batch
from fleetscope.producers.batch_split import encode_to_fit, split_by_job
from fleetscope.producers.spool import DiskSpool, Pending

log = logging.getLogger(__name__)

__all__ = ["Publisher", "PublisherStats", "split_by_job"]

# Room left in a message for its key, headers and record framing.
_MESSAGE_OVERHEAD = 1024
# Messages handed to librdkafka at once, at most; the rest wait in the spool, in order.
MAX_WINDOW = 1000


@dataclass
class PublisherStats:
    batches_sent: int = 0
    events_sent: int = 0
    delivery_errors: int = 0  # every failed delivery report, outages included
    refusals: int = 0  # a message refused for itself (not an outage), by the broker or by librdkafka
    dropped_batches: int = 0  # all drops: spool overflow, permanent refusals, oversized rows
    dropped_events: int = 0
    dropped_overflow_batches: int = 0
    dropped_permanent_batches: int = 0
    dropped_oversize_rows: int = 0
    split_batches: int = 0  # batches cut to fit the broker's message size
    producer_restarts: int = 0
    spooled: int = 0  # waiting behind the window
    spooled_bytes: int = 0
    in_flight: int = 0  # handed to librdkafka, not yet acknowledged
    spool_dir_bytes: int = 0
    spool_dir_corrupt: int = 0


def _is_outage(err) -> bool:
    """A failure that says nothing about the message itself: resend it, however often."""
    from confluent_kafka import KafkaError
    return err.code() in (KafkaError._MSG_TIMED_OUT, KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN,
                          KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT, KafkaError._TIMED_OUT,
                          KafkaError._FATAL, KafkaError.UNKNOWN_PRODUCER_ID,
                          KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, KafkaError.NOT_ENOUGH_REPLICAS,
                          KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND, KafkaError.LEADER_NOT_AVAILABLE,
                          KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.REQUEST_TIMED_OUT)



class Publisher:
    def __init__(self, cfg: Config, bootstrap: str, extra_conf: dict | None = None):
        self.cfg = cfg
        self.stats = PublisherStats()
        self._lock = threading.RLock()  # publish() runs on the agent and the XID watcher threads
        from fleetscope.kafka_settings import KafkaSecurity
        self._conf = {"bootstrap.servers": bootstrap, **KafkaSecurity.from_config(cfg).librdkafka(),
                      "acks": "all", "enable.idempotence": True,
                      "max.in.flight.requests.per.connection": 5,  # with idempotence: order kept across retries
                      "linger.ms": 5, "message.timeout.ms": 30_000, "queue.buffering.max.messages": 100_000,
                      "message.max.bytes": cfg.kafka_message_max_bytes,
                      "client.id": f"fleetscope-agent-{cfg.host}",
                      "log.connection.close": False}  # a broker going away is handled by the spool, not logged
        self._conf.update(extra_conf or {})
        self._limit = max(1000, int(self._conf["message.max.bytes"]) - _MESSAGE_OVERHEAD)
        self._window = max(1, min(cfg.spool_max_batches, MAX_WINDOW))
        self._waiting: list[Pending] = []  # a heap, oldest first
        self._in_flight: dict[int, Pending] = {}
        self._held_bytes = 0  # values in memory, waiting or in flight
        self._waiting_bytes = 0
        self._paused = False  # failed messages are coming back: hold new sends until all are in
        self._generation = 0
        self._restart_due = False
        self._disk = DiskSpool(cfg.spool_dir, cfg.spool_dir_max_bytes) if cfg.spool_dir else None
        first = 0
        if self._disk is not None:
            left = self._disk.load()
            for item in left:
                self._push(item)
            first = (left[-1].order[0] + 1) if left else 0
            if left:
                log.info("spool: %d messages left by a previous agent in %s will be sent first", len(left), cfg.spool_dir)
        self._orders = itertools.count(first)
        self._producer = self._new_producer()
        self._update_gauges()

    def _new_producer(self):
        from confluent_kafka import Producer
        self._generation += 1
        return Producer(self._conf)

    # --- publishing ---------------------------------------------------------------

    def publish(self, batch: Batch) -> None:
        with self._lock:
            for key, part in split_by_job(batch):
                self._enqueue_batch(key, part, (next(self._orders),))
            self._pump()
            self._poll(0)

    def _enqueue_batch(self, key: str, batch: Batch, order: tuple[int, ...], attempts: int = 0) -> None:
        pieces, dropped_rows = encode_to_fit(batch, self._limit - len(key), wire.encode)
        if dropped_rows:
            self.stats.dropped_oversize_rows += dropped_rows
            self._count_drop(dropped_rows, what="row(s) larger than the broker's message size "
                             f"({self._limit} bytes with framing)")
        if len(pieces) > 1:
            self.stats.split_batches += 1
        for i, (piece, value) in enumerate(pieces):
            item = Pending(order=order + (i,) if len(pieces) > 1 else order, topic=self.cfg.raw_topic(piece.source),
                           key=key.encode(), headers=piece.kafka_headers(), count=piece.count, size=len(value),
                           value=value, attempts=attempts)
            self._hold(item)

    def _push(self, item: Pending) -> None:
        heapq.heappush(self._waiting, item)
        self._waiting_bytes += item.size

    def _pop(self) -> Pending:
        item = heapq.heappop(self._waiting)
        self._waiting_bytes -= item.size
        return item

    def _hold(self, item: Pending) -> None:
        if self._disk is not None:
            self._disk.write(item)
            item.value = None  # on disk until it is sent: memory holds only what is in flight
        else:
            self._held_bytes += item.size
        self._push(item)
        self._enforce_bounds()

    def _enforce_bounds(self) -> None:
        def over() -> bool:
            if len(self._waiting) + len(self._in_flight) > self.cfg.spool_max_batches:
                return True
            if self._held_bytes > self.cfg.spool_max_bytes:
                return True
            return self._disk is not None and self._disk.bytes > self._disk.max_bytes

        while self._waiting and over():
            dropped = self._pop()
            self._release(dropped)
            self.stats.dropped_overflow_batches += 1
            self.stats.dropped_batches += 1
            self._count_drop(dropped.count, what=f"the oldest waiting batch: the spool is full "
                             f"({self.cfg.spool_max_batches} batches, {self.cfg.spool_max_bytes} bytes in memory)")

    def _count_drop(self, events: int, what: str) -> None:
        self.stats.dropped_events += events
        log.warning("dropped %d events: %s", events, what)

    def _release(self, item: Pending) -> None:
        """The message is done (acknowledged or dropped): free its memory and its file."""
        if item.value is not None:
            self._held_bytes -= item.size
            item.value = None
        if self._disk is not None:
            self._disk.remove(item)

    def _pump(self) -> None:
        """Hand waiting messages to librdkafka, oldest first, while the window has room."""
        from confluent_kafka import KafkaError, KafkaException
        if self._restart_due:
            self._restart_producer()
        while self._waiting and not self._paused and len(self._in_flight) < self._window:
            item = self._waiting[0]
            value = item.value if item.value is not None else self._disk.read_value(item)
            try:
                self._producer.produce(item.topic, value=value, key=item.key, headers=item.headers,
                                       on_delivery=self._on_delivery(item, self._generation))
            except BufferError:  # librdkafka's own queue is full: the rest waits for the next tick
                break
            except KafkaException as e:
                if e.args[0].fatal():
                    self._restart_producer()
                    continue
                self._pop()
                self._refused(item, e.args[0], value)
                continue
            self._pop()
            if item.value is None:  # read back from disk: it is in memory while in flight
                item.value = value
                self._held_bytes += item.size
            item.generation = self._generation
            self._in_flight[id(item)] = item
        self._update_gauges()

    def _on_delivery(self, item: Pending, generation: int):
        def delivered(err, _msg):
            with self._lock:
                if self._in_flight.get(id(item)) is not item or item.generation != generation:
                    return  # a replaced producer's late report: the message was already taken back
                del self._in_flight[id(item)]
                if err is None:
                    self.stats.batches_sent += 1
                    self.stats.events_sent += item.count
                    self._release(item)
                else:
                    self.stats.delivery_errors += 1
                    self._failed(item, err)
                if self._paused and not self._in_flight:
                    # Every failed message is back in the spool, in order. The producer that failed them may
                    # hold a producer id the broker forgot (tansu after a restart; Kafka once producer state
                    # expires) and retry it forever without an error: resend through a fresh one.
                    self._paused = False
                    self._restart_due = True
                self._update_gauges()
        return delivered

    def _failed(self, item: Pending, err) -> None:
        if err.fatal():
            self._restart_due = True
        if err.fatal() or _is_outage(err):
            self._paused = True  # later messages may still come back failed: let them, then resend in order
            self._push(item)
            return
        self._refused(item, err, item.value)

    def _refused(self, item: Pending, err, value: bytes) -> None:
        """The broker (or librdkafka) refused this very message."""
        from confluent_kafka import KafkaError
        if err.code() == KafkaError.MSG_SIZE_TOO_LARGE and value is not None:
            # the broker's limit is lower than ours: split this one smaller and resend it in its place
            self._release(item)
            self._limit = max(1000, min(self._limit, item.size) // 2)
            log.warning("the broker refused a %d-byte message as too large: splitting to %d bytes", item.size, self._limit)
            self._enqueue_batch(item.key.decode(), wire.decode(value), item.order, item.attempts)
            return
        item.attempts += 1
        self.stats.refusals += 1
        if item.attempts > self.cfg.delivery_max_retries:
            self._release(item)
            self.stats.dropped_permanent_batches += 1
            self.stats.dropped_batches += 1
            self._count_drop(item.count, what=f"refused {item.attempts} times by Kafka on {item.topic}: {err.str()}")
            return
        log.warning("Kafka refused a batch for %s (%s): try %d of %d", item.topic, err.str(), item.attempts,
                    self.cfg.delivery_max_retries + 1)
        self._push(item)

    def _restart_producer(self) -> None:
        """Take back every message the producer held, in order, and start a new producer."""
        self._restart_due = False
        old = self._producer
        for item in list(self._in_flight.values()):
            self._push(item)
        self._in_flight.clear()
        self._paused = False
        release_producer(old)
        self.stats.producer_restarts += 1
        log.warning("replaced the Kafka producer after failed deliveries; %d messages will be resent in order",
                    len(self._waiting))
        self._producer = self._new_producer()

    def _poll(self, timeout_s: float) -> None:
        from confluent_kafka import KafkaException
        try:
            self._producer.poll(timeout_s)
        except KafkaException as e:
            if e.args and e.args[0].fatal():
                self._restart_due = True
            else:
                log.warning("Kafka producer: %s", e)

    def _update_gauges(self) -> None:
        self.stats.spooled = len(self._waiting)
        self.stats.spooled_bytes = self._waiting_bytes
        self.stats.in_flight = len(self._in_flight)
        if self._disk is not None:
            self.stats.spool_dir_bytes = self._disk.bytes
            self.stats.spool_dir_corrupt = self._disk.corrupt

    # --- the agent's tick and stop ----------------------------------------------

    def retry_spool(self) -> None:
        """Send what waits in the spool (as the window allows); called on every agent tick."""
        with self._lock:
            self._poll(0)
            self._pump()

    def held(self) -> int:
        with self._lock:
            return len(self._waiting) + len(self._in_flight)

    def flush(self, timeout_s: float = 10.0) -> int:
        """Deliver what is held for at most timeout_s; returns how many messages are still held.

        With a spool directory, what is still held stays in it for the next
        agent; without one it is counted as dropped by whoever stops us.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                self._pump()
                self._poll(0)
                if not self._waiting and not self._in_flight:
                    return 0
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._poll(min(0.1, left))
        with self._lock:
            return len(self._waiting) + len(self._in_flight)

    def close(self, timeout_s: float = 10.0) -> int:
        """Flush, then take back what is still in flight: into the spool directory if there is one,
        else counted as dropped. Returns how many messages did not reach Kafka."""
        left = self.flush(timeout_s)
        with self._lock:
            if not left:
                release_producer(self._producer)
                return 0
            in_flight = list(self._in_flight.values())
            self._in_flight.clear()
            release_producer(self._producer)
            held = in_flight + list(self._waiting)
            self._waiting, self._waiting_bytes = [], 0
            if self._disk is not None:
                for item in held:
                    if item.path is None and item.value is not None:
                        self._disk.write(item)
                log.warning("%d batches undelivered at stop are kept in %s for the next agent", len(held),
                            self.cfg.spool_dir)
            else:
                for item in held:
                    self._release(item)
                    self.stats.dropped_batches += 1
                    self._count_drop(item.count, what="undelivered when the agent stopped (no spool_dir set)")
            self._update_gauges()
            return len(held)
