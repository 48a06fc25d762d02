"""PythonTracer on real processes: Debian's /usr/bin/python3 (built with USDT) runs a known script.

Real eBPF, real USDT probes, real interpreter; nothing is stubbed. Note:
CPython 3.11 never fires its function__entry probe (CPython gh-98894), so
on this interpreter calls are counted on return and entries stay 0.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetscope.resources import package_dir
from support.batch_rows import rows, stop_all, values, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loading BPF programs needs root (CI runs as root)")

DEBIAN_PYTHON = "/usr/bin/python3"
WORKLOAD = package_dir("fleetscope.eval.workloads") / "py_calls.py"
LEAF, MIDDLE, GC = 2000, 1000, 5  # as in the workload


@pytest.fixture
def spawn():
    procs = []

    def start(*args, python=DEBIAN_PYTHON):
        p = subprocess.Popen([python, str(WORKLOAD), *map(str, args)])
        procs.append(p)
        return p

    yield start
    stop_all(procs)


@pytest.fixture(scope="module")
def tracer():
    from fleetscope.producers.tracers.python_vm import PythonTracer
    t = PythonTracer("node-a")
    yield t
    t.close()


def test_exact_counts_when_attached_before_the_calls(tracer, spawn, tmp_path):
    go = tmp_path / "go"
    p = spawn(go, 30)
    time.sleep(0.3)  # the interpreter is up and waiting for `go`
    assert tracer.add_pid(p.pid), tracer.unavailable.get(p.pid)
    tracer.sample()
    go.touch()
    wait_for(f"{go}.done")
    got = rows(tracer.sample())
    calls = values(got, "python.calls", p.pid)
    assert calls["py_calls:leaf"] == LEAF and calls["py_calls:middle"] == MIDDLE and calls["py_calls:run"] == 1
    counts = tracer.function_counts(p.pid)
    entries_fire = tracer.pids[p.pid][2]
    for fn, n in (("leaf", LEAF), ("middle", MIDDLE), ("run", 1)):
        assert counts[f"py_calls:{fn}"] == ((n if entries_fire else 0), n)
    assert values(got, "python.gc_count", p.pid) == {"all": GC}
    assert values(got, "python.gc_ns", p.pid)["all"] > 0
    assert all(r["sample_frac"] == pytest.approx(1.0, abs=0.01) for r in got)
    assert all(r["interval_ns"] > 0 for r in got)
    assert tracer.hits()["functions"] >= LEAF + MIDDLE and tracer.hits()["gc"] >= 2 * GC


def test_a_process_that_did_not_collect_reports_a_measured_zero(tracer, spawn, tmp_path):
    p = spawn(tmp_path / "never", 30)  # waits for a file that never comes: no calls, no GC
    time.sleep(0.3)
    assert tracer.add_pid(p.pid), tracer.unavailable.get(p.pid)
    tracer.sample()
    time.sleep(0.3)
    got = rows(tracer.sample())
    # a row, whatever the interpreter's own housekeeping collected (usually 0); before, no row at all
    assert set(values(got, "python.gc_count", p.pid)) == {"all"} == set(values(got, "python.gc_ns", p.pid))


def test_attached_mid_run_and_process_exit(tracer, spawn, tmp_path):
    go = tmp_path / "go"
    go.touch()
    p = spawn(go, "loop")
    time.sleep(0.5)  # calls are already under way
    assert tracer.add_pid(p.pid)
    time.sleep(0.5)
    # Freeze the process: the counters are read key by key, so a running loop would
    # move between the reads of `leaf` and `middle`.
    os.kill(p.pid, signal.SIGSTOP)
    got = values(rows(tracer.sample()), "python.calls", p.pid)
    # leaf runs twice per middle, counted on return: the middle cut at attach is counted
    # with 0-2 of its leaves, the middle cut at SIGSTOP leaves 0-2 leaves without it.
    assert got["py_calls:leaf"] > 100 and abs(got["py_calls:leaf"] - 2 * got["py_calls:middle"]) <= 2
    p.kill()
    p.wait()
    tracer.sample()  # the last deltas of the dead process, or None: no error either way
    assert p.pid not in tracer.pids
    assert tracer.sample() is None or p.pid not in {r["pid"] for r in rows(tracer.sample())}


def test_duty_cycling_detaches_and_reports_sample_frac(tracer, spawn, tmp_path):
    go = tmp_path / "go"
    go.touch()
    p = spawn(go, "loop")
    time.sleep(0.3)  # exec done: the interpreter is mapped
    assert tracer.add_pid(p.pid)
    tracer.sample()
    time.sleep(0.3)
    tracer.set_family_enabled("functions", False)
    hits_off = tracer.hits()["functions"]
    time.sleep(0.3)
    assert tracer.hits()["functions"] == hits_off  # detached: no probe runs at all
    got = rows(tracer.sample())
    frac = {r["sample_frac"] for r in got if r["metric"] == "python.calls" and r["pid"] == p.pid}
    assert frac and all(0.2 < f < 0.8 for f in frac)
    tracer.set_family_enabled("functions", True)
    time.sleep(0.3)
    assert tracer.hits()["functions"] > hits_off
    assert tracer.families() == {"functions": "expensive", "gc": "always"}


def test_interpreter_without_usdt_is_traced_for_gc_only_with_the_reason(tracer, spawn, tmp_path):
    p = spawn(tmp_path / "never", python=sys.executable)  # the venv's pyenv build: no USDT, symbols kept
    time.sleep(0.3)
    assert tracer.add_pid(p.pid) is True   # GC from the collector's symbol (tests/test_python_gc_without_usdt.py)
    why = tracer.gc_only[p.pid]
    assert "no USDT probe" in why and "--with-dtrace" in why and str(p.pid) in why


def test_file_prefix_filter_in_the_kernel(spawn, tmp_path):
    from fleetscope.producers.tracers.python_vm import PythonTracer
    go = tmp_path / "go"
    with PythonTracer("node-a", prefixes=(str(WORKLOAD.parent),)) as t:
        p = spawn(go, 30)
        time.sleep(0.3)
        assert t.add_pid(p.pid)
        go.touch()
        wait_for(f"{go}.done")
        calls = values(rows(t.sample()), "python.calls", p.pid)
    assert calls == {"py_calls:leaf": LEAF, "py_calls:middle": MIDDLE, "py_calls:run": 1}
