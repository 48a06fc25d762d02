"""Delivery guarantees of the stream worker's core (issue 14), against the real chDB engine and, where
publishing matters, the real embedded broker. Each test failed on the code before the issue.

Stand-ins, said where used: a store wrapper that refuses one batch, or that is "down" (raises on every
call) for a while; this machine has no ClickHouse server to stop, and chDB runs in-process.
"""
import logging
import time
import uuid

import numpy as np
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from fleetscope.config import Config
from fleetscope.schema import node_identity
from fleetscope.store.base import StoreError
from fleetscope.topics import all_topics, ensure_topics
from fleetscope.wire import Batch, StrColumn, encode
from fleetscope.streams.processor import STORE_RETRY_S, MessageRef, StreamProcessor
from fleetscope.streams.sinks import RawSink
from support.subscribed_sink import store_then_die_before_commit, subscribed_sink
from fleetscope.streams.store_writes import REJECT_AFTER

SEC = 10**9
HOUR = 3600 * SEC
T0 = (time.time_ns() // HOUR - 2) * HOUR  # within retention and the future-skew bound
TOPIC = "fleetscope.raw.host"


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def host_batch(ts_ns: int, host: str = "node-a", extra: dict | None = None) -> Batch:
    names = ("cpu.user", "cpu.idle", "mem.total", "mem.available")
    n = len(names)
    cols = {"ts_ns": np.full(n, ts_ns, dtype="<i8"), **node_identity(host, n),
            "metric": StrColumn(np.arange(n, dtype=np.uint32), names), "device": StrColumn.constant("all", n),
            "value": np.array([0.2, 0.3, 1000.0, 250.0]), "interval_ns": np.array([SEC // 2, SEC // 2, 0, 0], "<i8"),
            **(extra or {})}
    return Batch("host", host, cols)


def rank_batch(ts_ns: int, rank: int, tenant="acme", job="train", host="node-a") -> Batch:
    """Per-process NVML rows of one rank (rows, not a GPU: none here)."""
    names = ("nvml.proc_energy_j", "nvml.proc_sm_util")
    cols = {"ts_ns": np.full(2, ts_ns, dtype="<i8"), "tenant": StrColumn.constant(tenant, 2),
            "job": StrColumn.constant(job, 2), "rank": np.full(2, rank, dtype="<i4"),
            "pid": np.full(2, 4000 + rank, dtype="<i4"), "gpu": np.zeros(2, dtype="<i2"),
            "metric": StrColumn(np.arange(2, dtype=np.uint32), names), "device": StrColumn.constant("gpu0", 2),
            "value": np.array([100.0 + rank, 50.0]), "interval_ns": np.array([SEC // 2, 0], dtype="<i8")}
    return Batch("nvml", host, cols)


def make_processor(store, clock, tmp_path, producer=None, **cfg):
    cfg = Config(data_dir=tmp_path, window_s=1.0, allowed_lateness_s=0.5, idle_close_s=30, **cfg)
    return StreamProcessor(cfg, store, producer=producer, clock=clock)


class Feeder:
    """Hands messages to the processor as the Faust app does, recording which offsets were acknowledged."""

    def __init__(self, proc, topic=TOPIC, timestamp_ms=0):
        self.proc, self.topic, self.timestamp_ms = proc, topic, timestamp_ms
        self.acked: list[int] = []
        self.offset = 0

    def send(self, value, key=None) -> int:
        off = self.offset
        self.offset += 1
        ref = MessageRef(self.topic, 0, off, ack=lambda: self.acked.append(off), timestamp_ms=self.timestamp_ms)
        if key is None:
            self.proc.handle(value, None, ref)
        else:
            self.proc.handle(value, None, ref, key=key)
        return off


def count(store, sql, params=None):
    return store.query(sql, params).rows[0][0]


# ---- 1. any failure while handling a message: DLQ with the reason, never an escape --------------------

def test_a_mistyped_optional_column_is_refused_once_at_decode_with_the_reason(store, tmp_path):
    """sample_frac is optional on host batches; schema.validate checked only required columns, so a string
    sample_frac passed, failed in windowing (one dead letter) and again in the sink's insert (a second)."""
    clock = FakeClock()
    proc = make_processor(store, clock, tmp_path)
    feed = Feeder(proc)
    bad = feed.send(encode(host_batch(T0, extra={"sample_frac": StrColumn.constant("half", 4)})))
    good = [feed.send(encode(host_batch(T0 + k * SEC))) for k in range(3)]
    proc.flush()
    rows = store.query("SELECT offset, reason FROM dlq").rows
    assert rows == [(bad, "host column 'sample_frac' must be float64, got str")]
    assert bad in feed.acked  # acknowledged only now that its dead letter is stored
    assert count(store, "SELECT count() FROM raw_metrics") == 4 * len(good)
    assert proc.stats.dlq == 1 and proc.sink.stats.store_rejected == 0


# ---- 2. a batch the store refuses is isolated; the rest is stored --------------------------------------

def test_the_store_refusing_one_batch_dead_letters_it_and_stores_the_others(store):
    """Real chDB refusing real data: a lone surrogate in `host` cannot be written as UTF-8."""
    good = [host_batch(T0 + k * SEC) for k in range(5)]
    poison = host_batch(T0 + 7 * SEC, host="node-\ud800")
    refused = RawSink(store).write(good[:2] + [poison] + good[2:])
    assert [b.batch_id for b, _ in refused] == [poison.batch_id]
    assert "store rejected it (raw_metrics)" in refused[0][1]
    assert count(store, "SELECT count() FROM raw_metrics") == 4 * len(good)


class RefusesOneBatch:
    """The real chDB store, refusing every insert that holds one given batch id: a stand-in for a
    poison batch (the new codec cannot even encode the lone surrogate that did this before)."""

    def __init__(self, store, batch_id):
        self.store, self.batch_id, self.refusals = store, batch_id, 0

    def insert(self, table, columns, dedupe_token=None):
        if table == "raw_metrics" and self.batch_id in set(columns.column("batch_id").to_pylist()):
            self.refusals += 1
            raise StoreError("Code: 117. DB::Exception: cannot parse input")
        return self.store.insert(table, columns, dedupe_token=dedupe_token)

    def query(self, sql, params=None):
        return self.store.query(sql, params)


def test_a_poison_batch_stops_nothing_else_and_reaches_the_dlq(store, tmp_path):
    clock = FakeClock()
    batches = [host_batch(T0 + k * SEC // 2) for k in range(12)]
    refusing = RefusesOneBatch(store, batches[5].batch_id)
    proc = make_processor(refusing, clock, tmp_path)
    feed = Feeder(proc)
    for b in batches:
        feed.send(encode(b))
    for _ in range(REJECT_AFTER + 2):  # each retry after STORE_RETRY_S; the old code retried the whole flush forever
        proc.flush()
        clock.now += STORE_RETRY_S
    assert count(store, "SELECT count() FROM raw_metrics") == 4 * 11
    rows = store.query("SELECT offset, batch_id, reason FROM dlq").rows
    assert [(r[0], r[1]) for r in rows] == [(5, batches[5].batch_id)]
    assert "store rejected it" in rows[0][2] and "cannot parse input" in rows[0][2]
    assert refusing.refusals <= 2 * REJECT_AFTER + 4  # bisected down to the one batch, then a bounded number of tries
    assert 5 in feed.acked and proc.stats.store_rejected == 1
    # later traffic is stored at once
    later = feed.send(encode(host_batch(T0 + 20 * SEC)))
    clock.now += 60
    proc.flush()
    assert count(store, "SELECT count() FROM raw_metrics") == 4 * 12 and later in feed.acked


# ---- 3. event times are bounded ------------------------------------------------------------------------

def test_far_future_and_out_of_range_event_times_go_to_the_dlq_and_the_key_keeps_working(store, tmp_path):
    clock = FakeClock()
    proc = make_processor(store, clock, tmp_path)
    feed = Feeder(proc)

    def send(batch):
        off = feed.send(encode(batch))
        proc.flush()  # as often as the worker does: a jumped watermark closed windows too early
        return off

    for k in range(4):
        send(host_batch(T0 + k * SEC // 2))
    future = send(host_batch(T0 + 365 * 24 * HOUR))  # a year ahead: a broken clock
    y1850 = send(host_batch(-3_786_825_600 * SEC))
    y2262 = send(host_batch(9_200_000_000 * SEC))
    for k in range(4, 12):
        send(host_batch(T0 + k * SEC // 2))
    proc.flush(force=True)
    reasons = dict(store.query("SELECT offset, reason FROM dlq").rows)
    assert set(reasons) == {future, y1850, y2262}
    assert "ahead of this worker's clock (max_future_skew_s=300)" in reasons[future]
    assert "older than the retention (ttl_days=7)" in reasons[y1850]
    assert "ahead" in reasons[y2262]
    # every window of the key got all its events: the future batch moved no watermark
    per_window = store.query("SELECT event_count FROM features ORDER BY window_start").rows
    assert per_window == [(8,)] * 6
    assert proc.snapshot()["late_events"] == 0
    assert count(store, "SELECT count() FROM raw_metrics") == 4 * 12


# ---- 4. the Kafka key agrees with the batch --------------------------------------------------------------

def test_a_key_that_disagrees_with_the_batch_goes_to_the_dlq(store, tmp_path):
    clock = FakeClock()
    proc = make_processor(store, clock, tmp_path)
    feed = Feeder(proc, topic="fleetscope.raw.nvml")
    wrong = feed.send(encode(rank_batch(T0, 3)), key=b"acme/other-job")
    missing = feed.offset
    ref = MessageRef("fleetscope.raw.nvml", 0, feed.offset, ack=lambda off=feed.offset: feed.acked.append(off))
    feed.offset += 1
    proc.handle(encode(rank_batch(T0 + SEC, 3)), None, ref, key=None)
    right = feed.send(encode(rank_batch(T0 + 2 * SEC, 3)), key=b"acme/train")
    proc.flush()
    reasons = dict(store.query("SELECT offset, reason FROM dlq").rows)
    assert "message key 'acme/other-job' disagrees with the batch's tenant/job 'acme/train'" in reasons[wrong]
    assert "message has no key; expected 'acme/train'" in reasons[missing]
    assert right not in reasons
    assert count(store, "SELECT count() FROM raw_metrics") == 2


# ---- 5. dead letters of two runs are both kept -------------------------------------------------------

def test_a_second_runs_dead_letter_at_the_same_offset_is_not_deduplicated_away(store, tmp_path):
    """The embedded broker restarts offsets at 0 with every run: two runs' first dead letters share
    topic/partition/offset, and the old token (just those) made the engine drop the second."""
    for run, (payload, ts_ms) in enumerate([(b"garbage of the first run", 1_000), (b"garbage of the first run", 2_000),
                                             (b"other garbage, second run", 2_000)]):
        proc = make_processor(store, FakeClock(), tmp_path)
        Feeder(proc, timestamp_ms=ts_ms).send(payload)
        proc.flush()
        assert count(store, "SELECT count() FROM dlq") == run + 1
    # the same message handled twice (a replay after a crash) is still one dead letter
    proc = make_processor(store, FakeClock(), tmp_path)
    Feeder(proc, timestamp_ms=2_000).send(b"other garbage, second run")
    proc.flush()
    assert count(store, "SELECT count() FROM dlq") == 3


# ---- 6. the store down for 60 s ------------------------------------------------------------------------

class StoreThatGoesDown:
    """The real chDB store behind a switch: while `down`, every call fails as a stopped server's would.
    A stand-in for an outage: chDB runs inside this process and cannot be stopped on its own."""

    def __init__(self, store):
        self.store, self.down = store, False

    def insert(self, table, columns, dedupe_token=None):
        if self.down:
            raise StoreError("Code: 210. DB::NetException: Connection refused (localhost:8123)")
        return self.store.insert(table, columns, dedupe_token=dedupe_token)

    def query(self, sql, params=None):
        if self.down:
            raise StoreError("Code: 210. DB::NetException: Connection refused (localhost:8123)")
        return self.store.query(sql, params)


def published_score_windows(bootstrap, topic, partitions) -> list[int]:
    """window_start_ns of every score published so far (read back with the project's decoder)."""
    from fleetscope.wire import decode
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"check-{uuid.uuid4().hex[:6]}",
                         "fetch.wait.max.ms": 10, "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    out, idle = [], 0
    while idle < 3:
        msgs = [m for m in consumer.consume(100, 0.5) if not m.error()]
        idle = 0 if msgs else idle + 1
        for m in msgs:
            out += decode(m.value()).columns["window_start_ns"].tolist()
    consumer.close()
    return sorted(out)


def test_a_60_s_store_outage_loses_nothing_keeps_publishing_and_logs_once_per_period(store, tmp_path, broker,
                                                                                        caplog):
    run = uuid.uuid4().hex[:8]
    clock = FakeClock()
    down = StoreThatGoesDown(store)
    producer = Producer({"bootstrap.servers": broker.bootstrap, "acks": "all", "linger.ms": 1})
    proc = make_processor(down, clock, tmp_path, producer=producer, topic_prefix=f"t{run}", partitions=1,
                          store_error_log_s=20.0, step_hold_s=1.0)
    ensure_topics(broker.bootstrap, all_topics(proc.cfg), 1)
    feed = Feeder(proc, topic=proc.cfg.raw_topic("nvml"))
    sent = 0

    def tick(k: int, ranks) -> None:  # one 0.5 s tick of event time, a flush every 0.25 s of worker time
        nonlocal sent
        for r in ranks:
            feed.send(encode(rank_batch(T0 + k * SEC // 2, r)), key=b"acme/train")
            sent += 2
        for _ in range(2):
            clock.now += 0.25
            proc.flush()

    for k in range(8):  # the store is up: rank 3's model starts
        tick(k, [3])
    assert count(store, "SELECT count() FROM scores") > 0
    caplog.clear()
    caplog.set_level(logging.INFO, logger="fleetscope.streams")
    acked_before = len(feed.acked)
    down.down = True
    outage_start_ns = T0 + 8 * SEC // 2
    for k in range(8, 8 + 120):  # 60 s; rank 4 is first seen during the outage
        tick(k, [3, 4])
    during = [w for w in published_score_windows(broker.bootstrap, proc.cfg.topic("scores"), 1) if w >= outage_start_ns]
    assert len(during) >= 50, "scores stopped being published while the store was down"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert 3 <= len(errors) <= 4, [r.getMessage() for r in errors]  # 60 s at one line per 20 s, not one per flush
    assert "failures in the last 20 s" in errors[-1].getMessage()
    assert sum(r.exc_info is not None for r in errors) == 1  # one traceback, at the start
    assert len(feed.acked) == acked_before  # nothing acknowledged while nothing could be stored
    down.down = False
    for k in range(128, 140):
        tick(k, [3, 4])
    clock.now += 60
    proc.flush(force=True)
    proc.flush(force=True)
    assert count(store, "SELECT count() FROM raw_metrics") == sent
    per_rank = dict(store.query("SELECT rank, count() FROM features GROUP BY rank").rows)
    assert per_rank[4] == 66  # windows of the key first seen during the outage: all of them, afterwards
    assert per_rank[3] == 70
    assert count(store, "SELECT count() FROM scores FINAL") == 136
    assert count(store, "SELECT count() FROM dlq") == 0
    assert sorted(feed.acked) == list(range(feed.offset))
    assert any("recovered after" in r.getMessage() for r in caplog.records)


# ---- 7. idle keys and job models are evicted, their models checkpointed first ---------------------------

def test_idle_keys_and_models_are_evicted_after_a_checkpoint_and_restored_on_return(store, tmp_path):
    clock = FakeClock()
    proc = make_processor(store, clock, tmp_path, idle_evict_s=120.0, step_hold_s=1.0)
    feed = Feeder(proc, topic="fleetscope.raw.nvml")

    def tick(k, job):
        feed.send(encode(rank_batch(T0 + k * SEC // 2, 3, job=job)), key=f"acme/{job}".encode())
        clock.now += 0.5
        proc.flush()

    for k in range(10):
        tick(k, "train")
    clock.now += 40  # past idle_close_s: its last windows close and are scored
    proc.flush()
    assert ("acme", "train") in proc.scorer.models and len(proc.windows.keys) == 1
    for k in range(10, 400):  # another job goes on for 195 s; "train" sends nothing
        tick(k, "other")
    assert ("acme", "train") not in proc.scorer.models
    assert ("acme", "train", "node-a", 3) not in proc.windows.keys
    assert ("acme", "other", "node-a", 3) in proc.windows.keys
    assert proc.snapshot()["evicted_models"] == 1
    saved = store.query("SELECT toUnixTimestamp64Milli(last_window) FROM model_state FINAL WHERE job = 'train'").rows
    assert saved and saved[0][0] >= (T0 + 4 * SEC) // 10**6  # checkpointed with what it learned
    restored = proc.scorer.stats.restored_models
    for k in range(400, 410):
        tick(k, "train")
    clock.now += 40
    proc.flush()
    assert proc.scorer.stats.restored_models == restored + 1


# ---- 8. a sink killed between storing and committing ------------------------------------------------------

def feature_message(run_host: str, start_ns: int) -> bytes:
    from types import SimpleNamespace
    from fleetscope.streams.sinks import features_batch
    w = SimpleNamespace(key=("_node", run_host, run_host, -1), start_ns=start_ns, end_ns=start_ns + SEC,
                        event_count=8, sources={"host"})
    return encode(features_batch("worker-a", [w], [{"cpu_busy_frac": 0.4}]))


def test_a_sink_killed_between_storing_and_committing_replays_into_the_dedupe(store, tmp_path, broker):
    """Real broker, real consumer group, real chDB. The kill is simulated at the one point that matters
    (after the inserts, before the commit): a real SIGKILL hits it only by chance (test_end_to_end)."""
    run = uuid.uuid4().hex[:8]
    cfg = Config(data_dir=tmp_path, topic_prefix=f"t{run}", consumer_group=f"g{run}", partitions=1)
    ensure_topics(broker.bootstrap, all_topics(cfg), 1)
    producer = Producer({"bootstrap.servers": broker.bootstrap, "acks": "all"})
    host = f"host-{run}"

    def publish(windows):
        for k in windows:
            producer.produce(cfg.topic("features"), key=f"_node/{host}".encode(),
                             value=feature_message(host, T0 + k * SEC))
        assert producer.flush(10) == 0

    def sink(poll_records):
        return subscribed_sink(cfg, store, broker.bootstrap, poll_records=poll_records)

    def stored():
        return count(store, "SELECT count() FROM features WHERE job = {h:String}", {"h": host})

    publish(range(6))
    first = sink(poll_records=3)
    store_then_die_before_commit(first)
    before_kill = stored()
    assert 1 <= before_kill <= 3
    publish(range(6, 10))  # more arrived meanwhile: the replayed poll would be grouped differently
    second = sink(poll_records=100)
    deadline = time.monotonic() + 60
    while stored() < 10 and time.monotonic() < deadline:
        second.step(0.5)
    for _ in range(5):  # anything the replay would still add
        second.step(0.2)
    second.consumer.close()
    per_window = store.query("SELECT window_start, count() FROM features WHERE job = {h:String} GROUP BY window_start "
                             "HAVING count() > 1", {"h": host}).rows
    assert per_window == [], f"windows stored twice without FINAL: {per_window}"
    assert stored() == 10
    assert second.replayed_polls == 1
