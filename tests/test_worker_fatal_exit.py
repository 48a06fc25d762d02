"""A `fleetscope streams` worker process whose Kafka producer failed for good exits by itself (issue 14):
status 1, one line saying why, and nothing it had not delivered committed, so a restarted worker (or the
group's next owner) replays it. tests/test_publish_acks.py checks the processor's side in process; this is
the process, end to end.

Real parts: the launcher's stack with a broker of its own (cli/launcher.py; frozen with SIGSTOP, as in
tests/test_chaos.py, so no other test is disturbed), a `fleetscope streams` process, a real feed producer.
The worker's outputs time out after 1 s (kafka_delivery_timeout_s; 300 s by default), so the outage that fences
its idempotent producer is short.
"""
from __future__ import annotations

import time
import uuid

import pytest

from fleetscope.cli.launcher import EmbeddedStack
from fleetscope.config import Config
from fleetscope.streams.stats_file import read_worker_stats
from support.processes import wait_until
from support.host_feed import Feed

pytestmark = [pytest.mark.slow, pytest.mark.integration]

FATAL_LINE = "fleetscope streams: the Kafka producer failed for good"
IDLE_CLOSE_S = 10.0  # how long the test has, after the worker read the last input, to freeze the broker
BEFORE, DURING = 6, 2  # input messages (one host, 0.5 s of event time each) before and across the outage


def stats_after(stack, pid: int, since_ns: int):
    """The worker's counters, once written after `since_ns` (time.time_ns)."""
    doc = read_worker_stats(stack.data_dir, pid)
    return doc if doc is not None and doc["written_at_ns"] > since_ns else None


def uncommitted(stack):
    """[messages of the raw topics the worker's group has not committed], or None while Kafka does not say."""
    lag = stack.worker_lag()
    return None if lag is None else [lag]


def test_a_worker_whose_producer_failed_for_good_exits_1_and_commits_nothing_undelivered(tmp_path):
    run = uuid.uuid4().hex[:8]
    cfg = Config(data_dir=tmp_path, topic_prefix=f"f{run}", consumer_group=f"g{run}", partitions=1, window_s=1.0,
                 allowed_lateness_s=0.5, idle_close_s=IDLE_CLOSE_S, host=f"fatal-{run}", metrics_port=0, trace=(),
                 kafka_delivery_timeout_s=1.0)  # its outputs time out 1 s into the freeze
    stack = EmbeddedStack(cfg, workers=1).start()
    try:
        worker = stack.workers[0]
        feed = Feed(stack.cfg, f"fatal-{run}", hosts=1)
        for _ in range(BEFORE):
            feed.round()
        feed.finish()

        def all_published_and_committed():
            w = stack.worker_stats()
            return (w is not None and w["events_in"] == feed.sent and w["open_windows"] == 0
                    and w["unacked_messages"] == 0 and w["publish_errors"] == 0 and stack.worker_lag() == 0)
        stack.wait_for(all_published_and_committed, 120, "the first windows published and their input committed")

        # two more messages, in one window that only closes when its key has been idle for IDLE_CLOSE_S:
        # the worker has read them, and publishes their window while the broker is frozen
        for _ in range(DURING):
            feed.round()
        feed.finish()
        stack.wait_for(lambda: (stack.worker_stats() or {}).get("events_in") == feed.sent, 60,
                       "the worker reading the last messages")
        frozen_at_ns = time.time_ns()
        stack.pause("broker")
        try:
            at_freeze = stack.wait_for(lambda: stats_after(stack, worker.pid, frozen_at_ns), 30,
                                       "the worker's counters after the freeze")
            assert at_freeze["unacked_messages"] == DURING, (
                f"the last window was published before the broker was frozen (load held the test for more than "
                f"{IDLE_CLOSE_S} s): {at_freeze}")
            stack.wait_for(lambda: (stack.worker_stats() or {}).get("publish_errors", 0) > 0, 120,
                           "a delivery of the last window timing out while the broker is frozen")
        finally:
            stack.resume("broker")  # tansu now answers the worker's producer PRODUCER_FENCED, for good

        thawed = time.monotonic()
        deadline = thawed + 120
        while worker.alive():
            assert time.monotonic() < deadline, (f"the worker did not exit within 120 s of the fatal error: "
                                                 f"{stack.worker_stats()}\n{worker.tail()}")
            time.sleep(0.25)
        took = time.monotonic() - thawed
        log = worker.log_path.read_text(errors="replace")
        assert worker.returncode == 1, f"exit status {worker.returncode}\n{worker.tail()}"
        lines = [line for line in log.splitlines() if line.startswith(FATAL_LINE)]
        assert len(lines) == 1, f"{lines}\n{worker.tail()}"
        assert lines[0].endswith("restart the worker to get a new one"), lines[0]

        # the first messages stay committed; the two whose window never reached Kafka are not
        lag = wait_until(lambda: uncommitted(stack), 30)[0]  # not stack.wait_for: it fails on the exited worker
        assert lag == DURING, f"{lag} messages not committed, {DURING} expected"
        print(f"the worker exited {took:.1f} s after the broker was thawed")
    finally:
        stack.stop()
