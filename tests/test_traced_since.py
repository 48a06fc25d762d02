"""The scenario clock waits for the tracers to reach every rank, and ten windows more.

A source that joins a rank mid-run is judged by the peer detector against the rank's own usual offset,
learned from the source's first windows; a fault that starts as the source joins becomes that offset.
Measured in a loaded CI run: the tracers reached the ranks 1.5 s before the straggler, which was flagged
in 7 of its 15 windows. The manager's tests use stand-in tracers (what they pin is the manager's
bookkeeping of attempts, not a probe) on a real process; the runner's use a stand-in stack, since the
moment tracers attach cannot be set on a real one. test_eval_runner runs the whole path for real.
"""
from __future__ import annotations

import math
import time

from fleetscope.eval.runner import TRACED_WINDOWS_BEFORE_CLOCK, Run, RunOptions
from fleetscope.eval.scenario import load_scenario
from fleetscope.producers.tracing_source import TracingSource
from support import stand_in_tracer
from support.stand_in_tracer import StandInTracer, manager_for

rank = stand_in_tracer.rank  # a fixture


def test_every_tracer_must_have_tried_every_pid_attached_waiting_or_failed(rank):
    quick, broken = StandInTracer(True), StandInTracer(RuntimeError("no such symbol"))
    m = manager_for(rank.pid, quick=quick, broken=broken)
    assert m.traced_since([rank.pid]) is None  # not polled yet
    before = time.time()
    m.poll_targets()
    after = time.time()
    since = m.traced_since([rank.pid])
    assert since is not None and before <= since <= after  # a failed attach is an answer too
    assert m.traced_since([rank.pid, 999_999_999]) is None  # a pid no tracer has tried
    assert m.traced_since([]) == 0.0


def test_a_tracer_that_attaches_later_moves_the_time_and_an_ended_pid_is_forgotten(rank, monkeypatch):
    waiting = StandInTracer(False)
    m = manager_for(rank.pid, waiting=waiting)
    m.poll_targets()
    first = m.traced_since([rank.pid])
    assert first is not None and waiting.tries == 1  # not mapping the library yet: tried
    waiting.answers = [True]
    monkeypatch.setattr("fleetscope.producers.tracers.manager.library_stamp", lambda pid: "dlopened")
    time.sleep(0.01)
    m.poll_targets()
    assert waiting.tries == 2 and m.traced_since([rank.pid]) > first  # its attach is when it joined
    rank.kill()
    rank.wait()
    m.poll_targets()
    assert m.traced_since([rank.pid]) is None and m.tried_at == {}


def test_the_source_answers_none_while_compiling_and_zero_when_no_manager_will_run():
    source = TracingSource(lambda: None)
    assert source.traced_since([1]) is None  # not started: it may still come
    source.start()
    source._thread.join(10)
    assert source.traced_since([1]) == 0.0  # nothing traces the ranks: nothing to wait for


SCENARIO = """
name: clock
workload: ddp_cpu
ranks: 2
duration_s: 4
window_s: 0.5
fault: {kind: cpu_quota, rank: 1, start_s: 1, duration_s: 1, strength: 0.9}
expect: {kb_entry: straggler_rank, ranks: [1]}
"""


class WarmStack:
    """Stands in for the embedded stack: the model is warm, and the tracers reached the ranks at ``traced``."""

    def __init__(self, traced):
        self.traced = traced

    def query(self, sql, params=None):
        return type("Rows", (), {"rows": [(1, 0, 1)]})()

    def traced_since(self, pids):
        return self.traced

    def check(self):
        pass


def run_with(tmp_path, traced) -> Run:
    path = tmp_path / "clock.yaml"
    path.write_text(SCENARIO)
    run = Run(load_scenario(path), RunOptions(out_dir=tmp_path, work_dir=tmp_path, progress=lambda m: None))
    run.stack, run.pids, run.workload_may_end = WarmStack(traced), {0: 11, 1: 12}, True
    return run


def test_the_clock_starts_ten_windows_after_the_tracers_reached_the_last_rank(tmp_path):
    now = time.time()
    run = run_with(tmp_path, traced=now)
    t0 = run.wait_warm()
    w = run.window_s
    # at the first window boundary 10 windows after the attach (1 s of slack: a loaded machine may stall the test)
    assert now + TRACED_WINDOWS_BEFORE_CLOCK * w <= t0 <= now + (TRACED_WINDOWS_BEFORE_CLOCK + 1) * w + 1.0
    assert math.isclose(t0 / w, round(t0 / w))  # on a window boundary
    assert run.timeline["traced_before_t0_s"] >= TRACED_WINDOWS_BEFORE_CLOCK * w


def test_tracers_that_reached_the_ranks_long_before_warm_up_ended_do_not_delay_the_clock(tmp_path):
    for traced in (0.0, time.time() - 60):  # nothing traces them; or they attached a minute ago
        run = run_with(tmp_path, traced=traced)
        before = time.time()
        t0 = run.wait_warm()
        assert before < t0 <= before + run.window_s + 1.0  # the next boundary, not 10 windows on (5 s)
