"""A worker that stalls on a backlog for longer than idle_close_s must not take the keys it has not reached yet
for silent. Their next events are queued in Kafka, not missing: closing their windows as idle would drop those
events as late. The real StreamProcessor and chDB store, with a fake wall clock; each message says where its
partition ends (`highwater`), as the Faust consumer reports it (streams/app.py `highwater`)."""
from __future__ import annotations

from fleetscope.streams.processor import MessageRef
from fleetscope.streams.windows import BEHIND_IDLE_FACTOR

from fleetscope.wire import encode

from support.host_processor import SEC, T0, FakeClock, host_batch, make_processor

TOPIC = "fleetscope.raw.host"
IDLE_S = 30  # make_processor's idle_close_s


BROKER_MS0 = T0 // 10**6  # the broker's timestamps (ms): the agent sends each tick as it samples it


def feed_one(proc, k: int, offset: int, highwater: int | None, acked: list, host: str = "node-a") -> None:
    """Message `offset` of partition 0: the host's tick k (two ticks per 1 s window), sent at its event time."""
    proc.handle(encode(host_batch(T0 + k * SEC // 2, 0.2, 0.3, host=host)), None,
                MessageRef(TOPIC, 0, offset, ack=lambda: acked.append((host, offset)), highwater=highwater,
                           timestamp_ms=BROKER_MS0 + k * 500))


def stored_windows(store) -> int:
    return store.query("SELECT count() FROM features").rows[0][0]


def test_a_stall_on_a_backlog_does_not_close_windows_whose_events_are_still_queued(store, tmp_path):
    clock, acked = FakeClock(), []
    proc = make_processor(store, clock, tmp_path)
    feed_one(proc, 0, offset=0, highwater=10, acked=acked)  # the window's first half; nine more messages queued
    proc.flush()
    clock.now += IDLE_S + 5  # the worker stalls (a slow flush on a loaded machine, a rebalance)
    proc.flush()
    assert stored_windows(store) == 0  # the window stays open: the partition is behind, not silent
    assert proc.snapshot()["partitions_behind"] == 1
    feed_one(proc, 1, offset=1, highwater=10, acked=acked)  # the window's second half arrives after the stall
    proc.flush()
    assert proc.snapshot()["late_events"] == 0
    clock.now += IDLE_S + 5
    feed_one(proc, 4, offset=2, highwater=3, acked=acked)  # caught up: the watermark closes the first window
    proc.flush()
    rows = store.query("SELECT event_count FROM features ORDER BY window_start").rows
    assert rows[0] == (20,)  # both halves, nothing dropped
    snap = proc.snapshot()
    assert snap["partitions_behind"] == 0 and snap["partition_end_unknown"] == 0


def test_before_the_fix_the_same_stall_dropped_the_queued_events_as_late(store, tmp_path):
    """The same stall without a known end of the partition (as every message was before): the window closes as
    idle, and its second half is dropped as late. This is the case the highwater prevents."""
    clock, acked = FakeClock(), []
    proc = make_processor(store, clock, tmp_path)
    feed_one(proc, 0, offset=0, highwater=None, acked=acked)
    proc.flush()
    clock.now += IDLE_S + 5
    proc.flush()
    assert stored_windows(store) == 1
    feed_one(proc, 1, offset=1, highwater=None, acked=acked)
    proc.flush()
    assert proc.snapshot()["late_events"] == 10
    assert proc.snapshot()["partition_end_unknown"] == 2  # counted: the worker's /metrics shows it


def test_a_caught_up_partition_still_closes_a_silent_key_on_the_wall_clock(store, tmp_path):
    clock, acked = FakeClock(), []
    proc = make_processor(store, clock, tmp_path)
    feed_one(proc, 0, offset=0, highwater=1, acked=acked)  # the partition's newest message
    proc.flush()
    clock.now += IDLE_S + 1
    proc.flush()
    assert stored_windows(store) == 1 and acked == [("node-a", 0)]


def test_a_partition_never_read_again_cannot_hold_a_window_forever(store, tmp_path):
    clock, acked = FakeClock(), []
    proc = make_processor(store, clock, tmp_path)
    feed_one(proc, 0, offset=0, highwater=10, acked=acked)
    proc.flush()
    clock.now += BEHIND_IDLE_FACTOR * IDLE_S - 1
    proc.flush()
    assert stored_windows(store) == 0
    clock.now += 2
    proc.flush()
    assert stored_windows(store) == 1 and acked == [("node-a", 0)]


def test_only_the_keys_of_the_partition_behind_wait(store, tmp_path):
    """Two hosts on two partitions: the worker is behind on one, caught up on the other."""
    clock, acked = FakeClock(), []
    proc = make_processor(store, clock, tmp_path)
    proc.handle(encode(host_batch(T0, 0.2, 0.3, host="node-a")), None,
                MessageRef(TOPIC, 0, 0, ack=lambda: acked.append("a"), highwater=5))
    proc.handle(encode(host_batch(T0, 0.2, 0.3, host="node-b")), None,
                MessageRef(TOPIC, 1, 0, ack=lambda: acked.append("b"), highwater=1))
    proc.flush()
    clock.now += IDLE_S + 1
    proc.flush()
    hosts = [r[0] for r in store.query("SELECT host FROM features").rows]
    assert hosts == ["node-b"] and acked == ["b"]


def test_a_partition_flowing_a_little_behind_its_end_still_shows_a_silent_key_in_time(store, tmp_path):
    """In a live worker the consumer prefetches, so a busy partition's last message handled is often not its
    newest. A rank that stops sending (a hang, a crash) must still close within idle_close_s: the messages of the
    other hosts read since span more than idle_close_s of broker time after its last one."""
    clock, acked = FakeClock(), []
    proc = make_processor(store, clock, tmp_path)
    feed_one(proc, 0, offset=0, highwater=3, acked=acked, host="node-hung")
    offset = 1
    for k in range(1, 2 * IDLE_S + 4):  # another host on the same partition, two messages behind its end
        clock.now += 0.5
        feed_one(proc, k, offset=offset, highwater=offset + 3, acked=acked, host="node-busy")
        offset += 1
    proc.flush()
    assert proc.snapshot()["partitions_behind"] == 1
    hosts = [r[0] for r in store.query("SELECT DISTINCT host FROM features").rows]
    assert "node-hung" in hosts  # closed as idle, although the partition is behind
