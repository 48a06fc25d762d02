"""An attach that raised is undone and tried again after 1, 2, 4 and 8 polls, then given up (counted): on a
loaded host the Python tracer's attach failed once in 2 of 3 kept straggler runs (bcc's "USDT failed to
instrument PID", a probe's link refused with ENOENT) and the rank went untraced for the whole run. The
manager's side with stand-in tracers on a real process (support/stand_in_tracer.py); the Python tracer's side
(a passing failure raised, a permanent one answered False) with the real tracer on a real interpreter, its
probe reader made to fail once."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from fleetscope.producers.tracers.manager import ATTACH_RETRIES
from support import stand_in_tracer
from support.batch_rows import stop_all
from support.python_scripts import wait_mapped
from support.stand_in_tracer import StandInTracer, manager_for

rank = stand_in_tracer.rank  # a fixture
POLL_S = 0.05
DEBIAN_PYTHON = "/usr/bin/python3"  # built with USDT probes


def poll_until(m, done, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, m.stats()
        m.poll_targets()
        time.sleep(POLL_S / 5)


def test_a_failed_attach_is_undone_and_tried_again_until_it_attaches(rank):
    flaky = StandInTracer([RuntimeError("USDT failed to instrument PID"), OSError(2, "LINK_CREATE"), True])
    m = manager_for(rank.pid, poll_s=POLL_S, flaky=flaky)
    m.poll_targets()
    assert (flaky.tries, flaky.removed, m.attached["flaky"]) == (1, 1, set())  # undone, so a retry starts clean
    m.poll_targets()
    assert flaky.tries == 1, "tried again at once, before its backoff"
    poll_until(m, lambda: rank.pid in m.attached["flaky"])
    assert (flaky.tries, flaky.removed) == (3, 2)
    stats = m.stats()
    assert stats["trace_attach_failures"] == 2 and stats["trace_attach_given_up"] == 0
    assert rank.pid not in m.failing["flaky"]
    for _ in range(5):
        m.poll_targets()
    assert flaky.tries == 3  # attached: never tried again


def test_an_attach_that_keeps_failing_is_given_up_after_its_retries_and_backs_off_between(rank):
    broken = StandInTracer(RuntimeError("no such symbol"))
    m = manager_for(rank.pid, poll_s=POLL_S, broken=broken)
    started = time.monotonic()
    poll_until(m, lambda: m.attach_given_up == 1)
    assert broken.tries == ATTACH_RETRIES + 1 and broken.removed == broken.tries
    assert time.monotonic() - started >= POLL_S * (2 ** ATTACH_RETRIES - 1)  # 1 + 2 + 4 + 8 polls
    for _ in range(5):
        m.poll_targets()
    assert broken.tries == ATTACH_RETRIES + 1 and m.stats()["trace_attach_failures"] == ATTACH_RETRIES + 1


def test_an_ended_process_is_forgotten_with_its_failures(rank):
    broken = StandInTracer(RuntimeError("no such symbol"))
    m = manager_for(rank.pid, poll_s=POLL_S, broken=broken)
    m.poll_targets()
    assert rank.pid in m.failing["broken"]
    rank.kill()
    rank.wait()
    m.poll_targets()
    assert m.failing["broken"] == {} and broken.tries == 1


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="loading BPF programs needs root (CI runs as root)")


@needs_root
def test_the_python_tracer_raises_a_passing_failure_and_answers_false_when_permanent_or_gone(monkeypatch):
    from fleetscope.producers.tracers import python_vm

    tracer = python_vm.PythonTracer("node-a")
    real, calls = python_vm.python_probes, []

    def fails_once(pid):
        calls.append(pid)
        if len(calls) == 1:
            raise python_vm.UsdtUnreadable(f"cannot read the USDT probes of pid {pid}: USDT failed to instrument")
        return real(pid)

    monkeypatch.setattr(python_vm, "python_probes", fails_once)
    python = subprocess.Popen([DEBIAN_PYTHON, "-c", "import time; time.sleep(60)"])
    other = subprocess.Popen(["sleep", "60"])  # not a Python process: nothing to retry
    try:
        wait_mapped(python.pid, DEBIAN_PYTHON)
        with pytest.raises(python_vm.UsdtUnreadable):
            tracer.add_pid(python.pid)
        assert python.pid not in tracer.pids and "USDT failed" in tracer.unavailable[python.pid]
        assert tracer.add_pid(python.pid) is True and python.pid not in tracer.unavailable  # the retry attaches
        assert tracer.add_pid(other.pid) is False and other.pid in tracer.unavailable
        gone = subprocess.Popen(["true"])
        gone.wait()
        calls.clear()  # fails again, as bcc does for a process that exited: nothing to retry, no traceback logged
        assert tracer.add_pid(gone.pid) is False and gone.pid in tracer.unavailable
    finally:
        stop_all([python, other])
        tracer.close()
