"""The stream worker's core against the real chDB engine (no broker needed here;
tests/test_end_to_end.py runs the same core under Faust with the real broker)."""
import time

import numpy as np
import pytest

from fleetscope.config import Config
from fleetscope.schema import node_identity
from fleetscope.wire import Batch, StrColumn, encode
from fleetscope.streams.processor import MessageRef, StreamProcessor

from support.host_processor import HOUR, SEC, T0, FakeClock, host_batch, make_processor  # noqa: F401


def feed(proc, messages, acked, start_offset=0):
    for i, value in enumerate(messages):
        off = start_offset + i
        proc.handle(value, None, MessageRef("fleetscope.raw.host", 0, off, ack=lambda off=off: acked.append(off)))


def test_features_are_computed_per_window_from_the_deltas(store, tmp_path):
    clock, acked = FakeClock(), []
    proc = make_processor(store, clock, tmp_path)
    # two ticks per 1 s window, four windows; the last one stays open (watermark)
    msgs = [encode(host_batch(T0 + k * SEC // 2, busy_s=0.1 * (k + 1), idle_s=0.4)) for k in range(8)]
    feed(proc, msgs, acked)
    proc.flush()
    rows = store.query("SELECT toUnixTimestamp64Milli(window_start), feature['cpu_busy_frac'], "
                       "feature['mem_used_frac'], mapContains(feature, 'net_rx_bytes_per_s'), event_count "
                       "FROM features ORDER BY window_start").rows
    assert len(rows) == 3  # window 4 (ts up to T0+3.5 s) is within lateness: still open
    for w, (start_ms, busy, mem, has_net, count) in enumerate(rows):
        assert start_ms == (T0 + w * SEC) // 10**6
        b1, b2 = 0.1 * (2 * w + 1), 0.1 * (2 * w + 2)
        assert busy == pytest.approx((b1 + b2) / (b1 + b2 + 0.8))
        assert mem == pytest.approx(0.75)
        assert has_net == 0  # no network metrics in the window: masked, not zero
        assert count == 20
    # messages of closed windows are acknowledged; those feeding the open window are not
    assert acked == [0, 1, 2, 3, 4, 5]
    raw = store.query("SELECT count() FROM raw_metrics").rows[0][0]
    assert raw == 80


def test_bad_messages_go_to_the_dlq_and_good_ones_still_arrive(store, tmp_path):
    clock, acked = FakeClock(), []
    proc = make_processor(store, clock, tmp_path)
    good = [encode(host_batch(T0 + k * SEC, 0.2, 0.3)) for k in range(4)]
    truncated = good[0][:-10]
    future = bytearray(good[1])
    future[4] = 99
    feed(proc, [b"garbage: this is not a fleetscope batch", truncated, bytes(future), None] + good, acked)
    proc.flush()
    reasons = [r[0] for r in store.query("SELECT reason FROM dlq ORDER BY offset").rows]
    assert len(reasons) == 4
    assert "bad magic" in reasons[0] and "truncated" in reasons[1]
    assert reasons[2] and "no value" in reasons[3]  # the exact words for a corrupted header are the codec's
    assert store.query("SELECT count() FROM features").rows[0][0] == 2
    assert proc.stats.dlq == 4 and {0, 1, 2, 3} <= set(acked)


def test_the_same_batch_delivered_twice_is_counted_once(store, tmp_path):
    clock, acked = FakeClock(), []
    proc = make_processor(store, clock, tmp_path)
    msgs = [encode(host_batch(T0 + k * SEC, 0.2, 0.3)) for k in range(4)]
    feed(proc, msgs[:2] + [msgs[1]] + msgs[2:], acked)
    proc.flush()
    assert proc.stats.duplicate_batches == 1
    assert store.query("SELECT count() FROM raw_metrics").rows[0][0] == 40
    assert store.query("SELECT max(event_count) FROM features").rows[0][0] == 10


def test_restart_replays_unacknowledged_messages_without_loss_or_duplicates(store, tmp_path):
    msgs = [encode(host_batch(T0 + k * SEC // 2, 0.1, 0.4)) for k in range(20)]
    clock, acked = FakeClock(), []
    first = make_processor(store, clock, tmp_path)
    feed(first, msgs[:12], acked)
    first.flush()
    committed = max(o for o in range(len(acked) + 1) if list(range(o)) == sorted(acked)[:o])
    # "crash": the first worker vanishes; a new one resumes from the committed offset
    clock2, acked2 = FakeClock(), []
    second = make_processor(store, clock2, tmp_path)
    feed(second, msgs[committed:], acked2, start_offset=committed)
    second.flush(force=True)
    per_window = store.query("SELECT window_start, count() AS c, sum(event_count) FROM features "
                             "GROUP BY window_start ORDER BY window_start").rows
    assert len(per_window) == 10
    assert all(c == 1 for _, c, _ in per_window)
    assert all(events == 20 for _, _, events in per_window)
    assert store.query("SELECT count() FROM raw_metrics").rows[0][0] == 200


def test_idle_key_closes_on_wall_clock_without_new_events(store, tmp_path):
    clock, acked = FakeClock(), []
    proc = make_processor(store, clock, tmp_path)
    feed(proc, [encode(host_batch(T0, 0.2, 0.3))], acked)
    proc.flush()
    assert store.query("SELECT count() FROM features").rows[0][0] == 0
    clock.now += 31
    proc.flush()
    assert store.query("SELECT count() FROM features").rows[0][0] == 1
    assert acked == [0]


def test_late_events_are_counted_not_silently_dropped(store, tmp_path):
    clock, acked = FakeClock(), []
    proc = make_processor(store, clock, tmp_path)
    feed(proc, [encode(host_batch(T0 + k * SEC, 0.2, 0.3)) for k in range(5)], acked)
    proc.flush()
    feed(proc, [encode(host_batch(T0, 0.2, 0.3))], acked, start_offset=5)
    proc.flush()
    assert proc.snapshot()["late_events"] == 10


class FlakyStore:
    """The real chDB store, but the next `failures` inserts fail (a stand-in for an outage)."""

    def __init__(self, store, failures):
        self.store, self.failures = store, failures

    def insert(self, *args, **kwargs):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("store unavailable")
        return self.store.insert(*args, **kwargs)

    def query(self, *args, **kwargs):
        return self.store.query(*args, **kwargs)


def test_a_failed_insert_acknowledges_nothing_and_its_retry_stores_everything_once(store, tmp_path):
    clock, acked = FakeClock(), []
    proc = make_processor(FlakyStore(store, failures=1), clock, tmp_path)
    feed(proc, [encode(host_batch(T0 + k * SEC, 0.2, 0.3)) for k in range(4)], acked)
    proc.flush()  # the features insert (one message: both windows of the key's job) fails; the store answers
    assert acked == [] and proc.stats.store_errors == 1
    clock.now += 1.0
    proc.flush()  # the retry
    assert sorted(acked) == [0, 1]  # the windows of messages 2 and 3 are still open
    assert store.query("SELECT count() FROM raw_metrics").rows[0][0] == 40
    assert store.query("SELECT count(), uniqExact(window_start) FROM features").rows[0] == (2, 2)
    assert store.query("SELECT count() FROM dlq").rows[0][0] == 0  # a passing refusal is no poison


def test_background_flusher_overlaps_storing_with_consuming_and_acks_in_the_loop(store, tmp_path):
    import asyncio
    import threading

    from fleetscope.streams.flusher import BackgroundFlusher

    clock, acked = FakeClock(), []
    proc = make_processor(store, clock, tmp_path)
    ack_threads = set()

    async def drive():
        flusher = BackgroundFlusher(proc)
        for k in range(6):
            ref = MessageRef("fleetscope.raw.host", 0, k,
                             ack=lambda k=k: (acked.append(k), ack_threads.add(threading.get_ident())))
            proc.handle(encode(host_batch(T0 + k * SEC, 0.2, 0.3)), None, ref)
            clock.now += 1
            await flusher.maybe_flush()
        for _ in range(50):
            clock.now += 1
            await flusher.maybe_flush()
            await asyncio.sleep(0.02)
        flusher.close()

    asyncio.run(drive())
    assert sorted(acked) == [0, 1, 2, 3, 4, 5]  # the last windows closed on idle
    assert ack_threads == {threading.get_ident()}
    assert store.query("SELECT count() FROM features").rows[0][0] == 6


def nvml_rank_batch(ts_ns: int, energy_j: float, sm_util: float) -> Batch:
    """Per-process NVML rows as the agent emits them for rank 3 of acme/train (no GPU here:
    these are the rows, not a device)."""
    names = ("nvml.proc_energy_j", "nvml.proc_sm_util")
    cols = {"ts_ns": np.full(2, ts_ns, dtype="<i8"), "tenant": StrColumn.constant("acme", 2),
            "job": StrColumn.constant("train", 2), "rank": np.full(2, 3, dtype="<i4"),
            "pid": np.full(2, 4242, dtype="<i4"), "gpu": np.zeros(2, dtype="<i2"),
            "metric": StrColumn(np.arange(2, dtype=np.uint32), names), "device": StrColumn.constant("gpu0", 2),
            "value": np.array([energy_j, sm_util]), "interval_ns": np.array([SEC // 2, 0], dtype="<i8")}
    return Batch("nvml", "node-a", cols)


def test_gpu_energy_is_summed_per_rank_and_window(store, tmp_path):
    clock, acked = FakeClock(), []
    proc = make_processor(store, clock, tmp_path)
    feed(proc, [encode(nvml_rank_batch(T0 + k * SEC // 2, energy_j=100.0 + k, sm_util=50.0 + k))
                for k in range(6)], acked)
    proc.flush()
    rows = store.query("SELECT rank, feature['gpu_energy_j'], feature['gpu_proc_sm_util'] FROM features "
                       "WHERE tenant = 'acme' ORDER BY window_start").rows
    assert rows[0] == (3, pytest.approx(201.0), pytest.approx(50.5))  # ticks 0 and 1
    assert rows[1] == (3, pytest.approx(205.0), pytest.approx(52.5))


def kernel_rank_batch(ts_ns: int, offcpu_ns: int) -> Batch:
    """Tracer rows for one traced process of rank 1 of acme/train, as the kernel tracer emits them."""
    names = ("kernel.offcpu_ns", "kernel.ctx_switches")
    cols = {"ts_ns": np.full(2, ts_ns, dtype="<i8"), "tenant": StrColumn.constant("acme", 2),
            "job": StrColumn.constant("train", 2), "rank": np.full(2, 1, dtype="<i4"),
            "pid": np.full(2, 77, dtype="<i4"), "gpu": np.full(2, -1, dtype="<i2"),
            "metric": StrColumn(np.arange(2, dtype=np.uint32), names), "device": StrColumn.constant("pid77", 2),
            "value": np.array([float(offcpu_ns), 50.0]), "interval_ns": np.full(2, SEC // 2, dtype="<i8")}
    return Batch("kernel", "node-a", cols)


def test_off_cpu_time_becomes_waiting_threads_per_rank_window(store, tmp_path):
    clock, acked = FakeClock(), []
    proc = make_processor(store, clock, tmp_path)
    feed(proc, [encode(kernel_rank_batch(T0 + k * SEC // 2, offcpu_ns=SEC // 4)) for k in range(6)], acked)
    proc.flush()
    row = store.query("SELECT feature['offcpu_threads'], feature['ctx_switches_per_s'] FROM features "
                      "WHERE tenant = 'acme' ORDER BY window_start LIMIT 1").rows[0]
    assert row == (pytest.approx(0.5), pytest.approx(100.0))  # 0.25 s off-CPU per 0.5 s tick
