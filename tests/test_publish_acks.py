"""The worker's flush does not wait for Kafka's acknowledgements (issue 14, "Delivery"): a flush job's
messages are sent, their delivery callbacks count the acknowledgements, and the job's input messages are
acknowledged (so committed) only once every one of them came back without error, in order. A delivery
error sends the job again, whole; its windows are never computed again.

Real parts: a private embedded broker (tansu, its own process, so freezing it disturbs no other test), the
worker's own producer settings (streams/worker.py derived_producer) and state reader (<prefix>.model-state),
the processor driven as the worker's flusher drives it (begin_flush / run_flush / finish_flush). The outage
is a frozen broker (SIGSTOP, then SIGCONT), as in tests/test_agent_stop.py: tansu keeps topics in memory
only, so a restarted one would lose them.
"""
from __future__ import annotations

import gc
import os
import signal
import time
import uuid
from collections import Counter

import numpy as np
import pytest
from confluent_kafka import Producer

from fleetscope import wire
from fleetscope.broker import EmbeddedBroker
from fleetscope.config import Config
from fleetscope.kafka_settings import client_conf
from fleetscope.schema import node_identity
from fleetscope.topic_reader import read_topic
from fleetscope.topics import prepare_topics
from fleetscope.wire import Batch, StrColumn, encode
from fleetscope.streams.model_state import JobState
from fleetscope.streams.outbox import Outbox
from fleetscope.streams.processor import MessageRef, StreamProcessor
from fleetscope.kafka_settings import release_producer
from fleetscope.streams.worker import derived_producer, state_reader
from support.kafka_clients import librdkafka_instances, wait_for_clients_at_most

pytestmark = pytest.mark.integration

SEC = 10**9
HOUR = 3600 * SEC
T0 = (time.time_ns() // HOUR - 1) * HOUR  # inside retention and the future-skew bound
HOST = "node-acks"
NAMES = ("cpu.user", "cpu.idle", "mem.total", "mem.available")


def host_batch(ts_ns: int) -> Batch:
    n = len(NAMES)
    cols = {"ts_ns": np.full(n, ts_ns, dtype="<i8"), **node_identity(HOST, n),
            "metric": StrColumn(np.arange(n, dtype=np.uint32), NAMES), "device": StrColumn.constant("all", n),
            "value": np.array([0.2, 0.3, 1000.0, 250.0]), "interval_ns": np.array([SEC // 2, SEC // 2, 0, 0], "<i8")}
    return Batch("host", HOST, cols)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Worker:
    """The processor as `fleetscope streams` runs it (no store), fed one host's batches on one partition;
    `acked` records the input offsets in the order they were acknowledged."""

    def __init__(self, cfg: Config, producer):
        self.clock = FakeClock()
        self.states = state_reader(cfg, cfg.kafka)
        self.proc = StreamProcessor(cfg, producer=producer, states=self.states, clock=self.clock)
        self.topic = cfg.raw_topic("host")
        self.acked: list[int] = []
        self.offset = 0
        self.flush_s: list[float] = []

    def tick(self, k: int) -> None:
        """One 0.5 s tick of event time, then one flush on this thread, timed."""
        off = self.offset
        self.offset += 1
        ref = MessageRef(self.topic, 0, off, ack=lambda: self.acked.append(off))
        self.proc.handle(encode(host_batch(T0 + k * SEC // 2)), None, ref, key=f"_node/{HOST}".encode())
        self.flush()

    def flush(self, force: bool = False) -> None:
        self.clock.now += 0.25
        job = self.proc.begin_flush(force)
        if job is not None:
            started = time.monotonic()
            ok = self.proc.run_flush(job)
            self.flush_s.append(time.monotonic() - started)
            self.proc.finish_flush(job, ok)

    def settle(self, done, timeout_s: float, what: str, force: bool = False) -> None:
        """Flush (as the worker's timer does) until `done()`; the callbacks fire on the flushes' polls."""
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {self.proc.snapshot()}"
            self.flush(force)
            time.sleep(0.02)

    def close(self) -> None:
        self.states.close()
        release_producer(self.proc.producer)   # as run_streams does: no client left reconnecting


def feature_windows(bootstrap: str, cfg: Config) -> Counter:
    """How often each of HOST's windows was published on <prefix>.features."""
    seen: Counter = Counter()
    for m in read_topic(bootstrap, cfg.topic("features"), partitions=1):
        b = wire.decode(m.value(), m.headers())
        if b.source == "features":
            seen.update(int(s) for s in b.columns["window_start_ns"])
    return seen


@pytest.fixture()
def own_broker(tmp_path):
    b = EmbeddedBroker(log_path=tmp_path / "broker.log").start()
    yield b
    os.kill(b.pid, signal.SIGCONT)  # never leave it frozen, whatever failed
    b.stop()


def worker_cfg(tmp_path, bootstrap: str) -> Config:
    run = uuid.uuid4().hex[:8]
    cfg = Config(data_dir=tmp_path, kafka=bootstrap, topic_prefix=f"a{run}", consumer_group=f"g{run}",
                 partitions=1, window_s=1.0, allowed_lateness_s=0.5, idle_close_s=3600, step_hold_s=1.0)
    prepare_topics(cfg, bootstrap)
    return cfg


def test_a_flush_does_not_wait_for_acks_and_acknowledges_its_inputs_only_after_them(tmp_path, own_broker):
    cfg = worker_cfg(tmp_path, own_broker.bootstrap)
    w = Worker(cfg, derived_producer(cfg, own_broker.bootstrap))
    try:
        for k in range(10):  # broker up: the key's state is read, the first windows go out
            w.tick(k)
        w.settle(lambda: w.proc.snapshot()["unstored_jobs"] == 0 and w.acked, 30, "the first windows' acks")
        acked_before = list(w.acked)
        computed_before = w.proc.scorer.stats.node_windows
        os.kill(own_broker.pid, signal.SIGSTOP)
        try:
            frozen_from = len(w.flush_s)
            for k in range(10, 20):  # 5 s of event time: 5 more windows close and are computed
                w.tick(k)
            frozen_flush_s = w.flush_s[frozen_from:]
            computed_frozen = w.proc.scorer.stats.node_windows - computed_before
            unstored = w.proc.snapshot()["unstored_jobs"]
            acked_frozen = list(w.acked)
        finally:
            os.kill(own_broker.pid, signal.SIGCONT)
        # the flush thread went on computing instead of waiting for Kafka (it waited 10 s per flush before)
        assert frozen_flush_s and max(frozen_flush_s) < 2.0, frozen_flush_s
        assert computed_frozen >= 4, computed_frozen
        # ... but nothing sent meanwhile was acknowledged: its jobs wait, in order, for their acks
        assert acked_frozen == acked_before
        assert unstored >= 4

        w.settle(lambda: w.proc.snapshot()["unstored_jobs"] == 0 and len(w.acked) > len(acked_before), 60,
                 "the acks sent while the broker was frozen")
        w.clock.now += 3600  # the end: every window closes
        w.settle(lambda: len(w.acked) == w.offset, 60, "every input acknowledged", force=True)
        assert w.acked == list(range(w.offset))  # each once, in offset order
        snap = w.proc.snapshot()
        assert snap["publish_errors"] == 0 and snap["dlq"] == 0, snap
        windows = feature_windows(own_broker.bootstrap, cfg)
        assert sorted(windows) == [T0 + i * SEC for i in range(10)]  # 20 ticks of 0.5 s: 10 windows
        assert set(windows.values()) == {1}, windows  # each published once: nothing was sent twice
        assert w.proc.scorer.stats.node_windows == 10  # and scored once
    finally:
        w.close()


def acked_then_failed_delivery(w: "Worker", broker) -> list[int]:
    """Six ticks acknowledged, then six more while the broker is frozen until a delivery fails (the broker is
    thawed again); the offsets acknowledged before the freeze."""
    for k in range(6):
        w.tick(k)
    w.settle(lambda: w.proc.snapshot()["unstored_jobs"] == 0 and w.acked, 30, "the first windows' acks")
    acked_before = list(w.acked)
    os.kill(broker.pid, signal.SIGSTOP)
    try:
        for k in range(6, 12):
            w.tick(k)
        w.settle(lambda: w.proc.stats.publish_errors > 0, 30, "a delivery error while the broker is frozen")
    finally:
        os.kill(broker.pid, signal.SIGCONT)
    return acked_before


def test_a_delivery_error_sends_the_job_again_without_computing_it_again(tmp_path, own_broker):
    """Kafka gives up on the messages (message.timeout.ms passes while the broker is frozen): the delivery
    callbacks report errors, counted in the stats; the jobs are sent again, whole and in order, once it answers.

    Not idempotent here: after timed-out messages, tansu answers an idempotent producer PRODUCER_FENCED from
    then on (measured), a fatal error for librdkafka, so that producer could never deliver again."""
    cfg = worker_cfg(tmp_path, own_broker.bootstrap)
    producer = Producer(client_conf(cfg, own_broker.bootstrap, **{
        "acks": "all", "linger.ms": 5, "message.timeout.ms": 1000}))
    w = Worker(cfg, producer)
    try:
        acked_before = acked_then_failed_delivery(w, own_broker)
        assert w.acked == acked_before  # a job whose delivery failed is not published
        w.clock.now += 3600
        w.settle(lambda: len(w.acked) == w.offset, 90, "every input acknowledged after the retry", force=True)
        assert w.acked == list(range(w.offset))
        windows = feature_windows(own_broker.bootstrap, cfg)
        assert sorted(windows) == [T0 + i * SEC for i in range(6)]  # every window out (some twice: resent)
        assert w.proc.scorer.stats.node_windows == 6  # computed and scored once, however often sent
        # the job's newest state is what a worker taking it over reads back. Not necessarily the last message:
        # this producer is not idempotent, so a first attempt that timed out at the client can still be written
        # after its resend (seen once in a loaded CI run: ..., T0+5 s, then T0+2 s); the reader folds states
        states = [JobState.decode(m.value()) for m in read_topic(own_broker.bootstrap, cfg.topic("model-state"))]
        assert states and max(s.last_window_ns for s in states) == T0 + 5 * SEC, [s.last_window_ns for s in states]
        reader = state_reader(cfg, own_broker.bootstrap)
        try:
            back = reader.latest("_node", HOST)
        finally:
            reader.close()
        assert back is not None and back.last_window_ns == T0 + 5 * SEC
        assert max(back.marks.values()) == T0 + 5 * SEC, back.marks
    finally:
        w.close()


def test_a_producer_that_reports_no_deliveries_is_refused(tmp_path):
    """An Outbox collects messages and delivers none: as the processor's producer, its jobs would wait forever."""
    cfg = Config(data_dir=tmp_path)
    with pytest.raises(TypeError):
        Outbox().produce("t", b"v", on_delivery=lambda err, msg: None)

    class NoPoll:
        def produce(self, *a, **kw):
            pass
    with pytest.raises(TypeError):
        StreamProcessor(cfg, producer=NoPoll(), states=object())


class CountingSends:
    """The real producer, counting the messages the processor hands it."""

    def __init__(self, producer):
        self.producer = producer
        self.sent = 0

    def produce(self, *args, **kwargs):
        self.sent += 1
        return self.producer.produce(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.producer, name)


def test_a_producer_that_failed_for_good_stops_the_worker_instead_of_resending_forever(tmp_path, own_broker):
    """The worker's own idempotent producer, with a short message timeout: after messages time out while the
    broker is frozen, tansu answers it PRODUCER_FENCED, a fatal error for librdkafka (measured; with the
    default timeout this takes a 5-minute outage). Every later send fails the same way, so resending would
    stall the worker forever with nothing acknowledged: the processor records the fatal error, stops
    publishing, and acknowledges nothing more (the worker then exits non-zero, streams/app.py and worker.py)."""
    cfg = worker_cfg(tmp_path, own_broker.bootstrap)
    producer = CountingSends(Producer(client_conf(cfg, own_broker.bootstrap, **{
        "acks": "all", "enable.idempotence": True, "linger.ms": 5, "message.timeout.ms": 1000})))
    w = Worker(cfg, producer)
    try:
        acked_before = acked_then_failed_delivery(w, own_broker)
        w.clock.now += 3600
        w.settle(lambda: w.proc.fatal_error is not None, 60, "the producer's fatal error", force=True)
        assert "restart the worker" in w.proc.fatal_error
        assert w.proc.snapshot()["fatal_error"] == w.proc.fatal_error
        sent = producer.sent
        for _ in range(20):  # no more sends: nothing is resent through the failed producer, nothing acked
            w.flush(force=True)
            time.sleep(0.02)
        assert producer.sent == sent
        assert w.acked == acked_before
        w.proc.close()   # the worker's stop: no final checkpoint through the failed producer, and no error
        assert producer.sent == sent
    finally:
        w.close()


def test_a_stopped_worker_leaves_no_kafka_client_behind(tmp_path, own_broker):
    """The worker stops while its outputs wait for a frozen broker. Each waiting message's delivery callback holds
    the processor, which holds the producer: a cycle through librdkafka that Python's collector cannot see.
    Stopping as run_streams does (release_producer) frees the producer and its threads; before, it stayed
    alive, reconnecting, for as long as the process ran (an in-process `fleetscope up` stack, these tests)."""
    gc.collect()  # earlier tests' garbage goes now, not in the middle of the counts below
    before = librdkafka_instances()
    cfg = worker_cfg(tmp_path, own_broker.bootstrap)
    w = Worker(cfg, derived_producer(cfg, own_broker.bootstrap))
    assert librdkafka_instances() >= before + 2  # its producer and its state reader
    for k in range(6):  # the job's state is read and its first windows go out while the broker answers
        w.tick(k)
    w.settle(lambda: w.acked, 30, "the first windows' acks")
    os.kill(own_broker.pid, signal.SIGSTOP)
    try:
        for k in range(6, 12):
            w.tick(k)
        w.flush(force=True)
        assert len(w.proc.producer) > 0  # outputs waiting, their callbacks holding the processor
        w.close()
        del w
        gc.collect()
        wait_for_clients_at_most(before)
    finally:
        os.kill(own_broker.pid, signal.SIGCONT)
