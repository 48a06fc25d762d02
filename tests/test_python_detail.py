"""PythonTracer detail mode: per-call records of GC pauses (and of function calls where functions are timed).

Real eBPF, real processes: the venv's interpreter (a pyenv build without USDT: the GC-only path, the collector's
entry and return) runs a script whose three phases each make COLLECTS explicit collections, timed with
time.monotonic_ns(): with the gate closed there are no records, with it open one "gc" record per collection (each
inside its measured gc.collect() call, durations summing to python.gc_ns), with it expired none again; the
program's output and exit code are an untraced run's. Debian's /usr/bin/python3 (USDT, CPython 3.11: its
function__entry never fires, so only GC has records) sends GC records with the gate open. The registry passes the
detail options and the prefixes to the python tracer (no root needed).
"""
import json
import os
import sys
import time
from pathlib import Path

import pytest

from fleetscope.config import Config
from fleetscope.producers.tracers.registry import tracer_class, tracer_options
from support.python_scripts import ScriptProcesses
from support.batch_rows import rows, values, wait_for

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="loading BPF programs needs root (CI runs as root)")

DEBIAN_PYTHON = "/usr/bin/python3"
COLLECTS = 15
PHASES = 3
# Automatic collection off (gc.collect() still collects), so every collection is one of the script's. For each
# phase k: waits for argv[1].k, makes COLLECTS rounds of cyclic garbage each collected explicitly and timed, writes
# the (start, end) monotonic ns of each collection to argv[1].k.spans (JSON), then argv[1].k.done. Prints what the
# collections found, waits (at most 60 s) for argv[1].exit and exits 3.
SCRIPT = f"""
import gc, json, os, sys, time

def wait(path):
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)

gc.disable()
go = sys.argv[1]
found = []
for phase in range({PHASES}):
    wait(f"{{go}}.{{phase}}")
    spans = []
    for _ in range({COLLECTS}):
        for _ in range(100):
            a = []
            a.append(a)
        del a
        t0 = time.monotonic_ns()
        found.append(gc.collect())
        spans.append((t0, time.monotonic_ns()))
    with open(f"{{go}}.{{phase}}.spans", "w") as f:
        json.dump(spans, f)
    open(f"{{go}}.{{phase}}.done", "w").close()
print(found)
sys.stdout.flush()
wait(go + ".exit")
sys.exit(3)
"""


@pytest.fixture
def spawn(tmp_path):
    script = tmp_path / "gc_phases.py"
    script.write_text(SCRIPT)
    procs = ScriptProcesses(script)
    yield procs.start
    procs.stop()


def run_phase(go, phase):
    """Let the script make one phase's collections; their measured (start, end) monotonic ns."""
    Path(f"{go}.{phase}").touch()
    wait_for(f"{go}.{phase}.done")
    return json.loads(Path(f"{go}.{phase}.spans").read_text())


def finish(p, go):
    Path(f"{go}.exit").touch()
    out, _ = p.communicate(timeout=60)
    return out, p.returncode


def untraced(spawn, tmp_path, python):
    go = tmp_path / "plain"
    p = spawn(go, python=python)
    for phase in range(PHASES):
        run_phase(go, phase)
    return finish(p, go)


def gc_deltas(batch, pid):
    got = rows(batch) if batch is not None else []
    count = values(got, "python.gc_count", pid).get("all", 0)
    ns = values(got, "python.gc_ns", pid).get("all", 0)
    return count, ns


@root_only
def test_gc_records_follow_the_gate_on_an_interpreter_without_usdt(spawn, tmp_path):
    from fleetscope.producers.tracers.python_vm import PythonTracer
    expected = untraced(spawn, tmp_path, sys.executable)
    assert expected[1] == 3 and expected[0].startswith("[")
    tracer = PythonTracer("node-a", detail=True, detail_always=False)
    try:
        assert tracer.detail_until == 0
        go = tmp_path / "go"
        p = spawn(go)
        assert tracer.add_pid(p.pid), tracer.unavailable.get(p.pid)
        if p.pid not in tracer.gc_only:
            pytest.skip(f"{sys.executable} has the USDT probes: this test is about the GC-only path")
        tracer.sample()

        # closed: the counters count, no records
        run_phase(go, 0)
        batch = tracer.sample()
        assert tracer.records == []
        assert gc_deltas(batch, p.pid)[0] == COLLECTS

        # open: one record per collection, inside its measured call
        opened = time.monotonic_ns()
        assert tracer.set_detail_until(opened + 600 * 10**9)
        spans = run_phase(go, 1)
        batch = tracer.sample()
        count, ns = gc_deltas(batch, p.pid)
        recs = [r for r in tracer.records if r["pid"] == p.pid]
        assert recs and all(r["api"] == "gc" and r["family"] == "gc" and r["tid"] == p.pid for r in recs), recs
        assert len(recs) == count >= COLLECTS
        assert sum(r["dur_ns"] for r in recs) == ns > 0
        epoch = [(tracer.clock.to_epoch_ns(a), tracer.clock.to_epoch_ns(b)) for a, b in spans]
        span_start = tracer.clock.to_epoch_ns(opened)
        for r in recs:
            start, end = r["ts_ns"], r["ts_ns"] + r["dur_ns"]
            assert start >= span_start and end <= tracer.clock.to_epoch_ns(time.monotonic_ns()), r
        inside = [r for r in recs if any(a <= r["ts_ns"] and r["ts_ns"] + r["dur_ns"] <= b for a, b in epoch)]
        assert len(inside) == COLLECTS == len(recs), (recs, epoch)

        # expired: a deadline already past sends nothing
        assert tracer.set_detail_until(time.monotonic_ns())
        run_phase(go, 2)
        batch = tracer.sample()
        assert tracer.records == []
        assert gc_deltas(batch, p.pid)[0] == COLLECTS

        assert finish(p, go) == expected
    finally:
        tracer.close()
    assert tracer.set_detail_until(10**18) is False  # closed: nothing to open


@root_only
def test_gc_records_from_an_interpreter_with_usdt(spawn, tmp_path):
    if not os.path.exists(DEBIAN_PYTHON):
        pytest.skip(f"no {DEBIAN_PYTHON}")
    from fleetscope.producers.tracers.python_vm import PythonTracer
    tracer = PythonTracer("node-a", detail=True)  # detail_always: open for good
    try:
        go = tmp_path / "go"
        p = spawn(go, python=DEBIAN_PYTHON)
        assert tracer.add_pid(p.pid), tracer.unavailable.get(p.pid)
        assert p.pid not in tracer.gc_only, f"{DEBIAN_PYTHON} should take the USDT path"
        tracer.sample()
        spans = run_phase(go, 0)
        batch = tracer.sample()
        count, ns = gc_deltas(batch, p.pid)
        gc_recs = [r for r in tracer.records if r["pid"] == p.pid and r["family"] == "gc"]
        assert len(gc_recs) == count >= COLLECTS
        assert all(r["api"] == "gc" and r["tid"] == p.pid for r in gc_recs)
        assert sum(r["dur_ns"] for r in gc_recs) == ns > 0
        epoch = [(tracer.clock.to_epoch_ns(a), tracer.clock.to_epoch_ns(b)) for a, b in spans]
        assert all(any(a <= r["ts_ns"] and r["ts_ns"] + r["dur_ns"] <= b for a, b in epoch) for r in gc_recs)
        # CPython 3.11-3.14 never reach function__entry: no function is timed, so none has a record
        if not tracer.pids[p.pid][2]:
            assert [r for r in tracer.records if r["family"] == "functions"] == []
        for phase in (1, 2):
            run_phase(go, phase)
        out, rc = finish(p, go)
        assert rc == 3
    finally:
        tracer.close()


def test_the_registry_passes_detail_options_and_prefixes_to_the_python_tracer():
    cfg = Config(trace_python_prefixes=("/srv/job/",), trace_capture_s=30.0, trace_capture_anomalies=False)
    opts = tracer_options("python", cfg)
    assert opts == {"prefixes": ("/srv/job/",), "detail": 30.0, "detail_always": False}
    import inspect
    params = inspect.signature(tracer_class("python").__init__).parameters
    assert {"prefixes", "detail", "detail_always", "ring_pages"} <= set(params)
