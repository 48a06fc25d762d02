"""The torch tracer's detail mode (bpf/torch.bpf.c under DETAIL, TorchTracer(detail=...), set_detail_until,
records): per-call records of ops and collective waits while the detail gate is open, none while it is closed
or expired, the aggregate rows counting every call either way, and the traced program unchanged.

Real PyTorch from the venv (run under Debian's /usr/bin/python3 with the venv's site-packages, as in
tests/test_torch_tracer.py), real processes, real uprobes and eBPF, real gloo over loopback. The workloads time
each of their calls with CLOCK_MONOTONIC, the clock bpf_ktime_get_ns reads, so every record (its start and
duration, converted back with the tracer's own clock offset) must lie inside one measured call."""
from __future__ import annotations

import bisect
import inspect
import json
import os
import socket
import subprocess
import sysconfig
import textwrap
import time

import pytest

from fleetscope.config import Config
from fleetscope.producers.tracers.registry import tracer_class, tracer_options
from support.batch_rows import rows, stop_all, values, wait_for

root = pytest.mark.skipif(os.geteuid() != 0, reason="loading BPF programs needs root (CI runs as root)")
ENV = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
CALLS = 300  # torch.mm calls per counted round

# torch.mm in rounds: round i starts when CTL/go<i> exists; "n:N" makes N calls, "s:S" calls for S seconds.
# Each call is timed (CLOCK_MONOTONIC ns before and after) and the round's times land in CTL/done<i>.json.
MM_LOOP = textwrap.dedent("""
    import json, os, sys, threading, time
    import torch
    ctl, rounds = sys.argv[1], sys.argv[2:]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    acc = torch.zeros(64, 64)
    for _ in range(5):
        torch.mm(a, b)  # warm-up, before any probe
    open(os.path.join(ctl, "ready"), "w").close()
    for i, spec in enumerate(rounds):
        go = os.path.join(ctl, f"go{i}")
        while not os.path.exists(go):
            time.sleep(0.005)
        kind, amount = spec.split(":")
        times, end = [], time.monotonic_ns() + int(float(amount) * 1e9)
        while (len(times) < int(amount)) if kind == "n" else (time.monotonic_ns() < end):
            t0 = time.monotonic_ns()
            c = torch.mm(a, b)
            times.append((t0, time.monotonic_ns()))
        if kind == "n":
            acc += c
        out = os.path.join(ctl, f"done{i}.json")
        with open(out + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "tid": threading.get_native_id(), "times": times}, f)
        os.replace(out + ".tmp", out)
    print(f"rounds={len(rounds)} checksum={float(acc.sum()):.4f}", flush=True)
    sys.exit(3)
""")
ROUNDS = [f"n:{CALLS}", f"n:{CALLS}", "s:1.5", f"n:{CALLS}"]  # closed, open, expiring mid-round, expired


def test_the_registry_gives_torch_the_detail_options():
    cfg = Config(trace_capture_s=10.0, trace_capture_anomalies=False)
    assert tracer_options("torch", cfg) == {"detail": 10.0, "detail_always": False}
    assert tracer_options("torch", Config()) == {"detail": 0.0, "detail_always": True}
    params = inspect.signature(tracer_class("torch").__init__).parameters
    assert params["detail"].default is False and params["detail_always"].default is True


def _run_round(ctl, i: int) -> dict:
    (ctl / f"go{i}").touch()
    wait_for(ctl / f"done{i}.json")
    return json.loads((ctl / f"done{i}.json").read_text())


def _match(records: list[dict], times: list, offset_ns: int) -> list[int]:
    """The index of the measured call each record lies inside (start and end); asserts every record has one,
    and no two the same call."""
    starts = [t0 for t0, _ in times]
    got = []
    for r in records:
        start = r["ts_ns"] - offset_ns  # back to bpf_ktime_get_ns, exactly: to_epoch_ns only added the offset
        i = bisect.bisect_right(starts, start) - 1
        assert i >= 0 and times[i][0] <= start and start + r["dur_ns"] <= times[i][1], (r, times[max(i, 0)])
        got.append(i)
    assert len(set(got)) == len(got), "two records of one call"
    return got


@root
def test_mm_records_follow_the_gate_and_the_program_is_unchanged(tmp_path):
    from fleetscope.chrome_trace import ChromeTrace
    from fleetscope.producers.tracers.torch_ops import TorchTracer
    script = tmp_path / "mm_loop.py"
    script.write_text(MM_LOOP)

    plain = tmp_path / "plain"  # the untraced run, for its output and exit status
    plain.mkdir()
    for i in range(len(ROUNDS)):
        (plain / f"go{i}").touch()
    untraced = subprocess.run(["/usr/bin/python3", str(script), str(plain), *ROUNDS], env=ENV,
                              capture_output=True, text=True, timeout=300)
    assert untraced.returncode == 3 and untraced.stdout.startswith("rounds=4 checksum="), untraced

    ctl = tmp_path / "traced"
    ctl.mkdir()
    p = subprocess.Popen(["/usr/bin/python3", str(script), str(ctl), *ROUNDS], env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    tracer = TorchTracer("node-a", ops=frozenset({"mm", "sum"}), detail=True, detail_always=False)
    try:
        wait_for(ctl / "ready")
        assert tracer.add_pid(p.pid), tracer.unavailable.get(p.pid)
        assert tracer.detail and tracer.detail_until == 0
        offset = tracer.clock.offset_ns
        tracer.sample()

        # closed: counted, not recorded
        _run_round(ctl, 0)
        got = rows(tracer.sample())
        assert values(got, "torch.ops", p.pid)["mm"] == CALLS
        assert tracer.records == []

        # open for the whole round: one record per call, inside it, with its pid and tid
        until = time.monotonic_ns() + 600 * 10**9
        assert tracer.set_detail_until(until) is True and tracer.detail_until == until
        run = _run_round(ctl, 1)
        got = rows(tracer.sample())
        records = [r for r in tracer.records if r["pid"] == p.pid]
        assert values(got, "torch.ops", p.pid)["mm"] == CALLS == len(run["times"])
        assert len(records) == CALLS and records == tracer.records
        assert {(r["api"], r["family"], r["tid"]) for r in records} == {("mm", "ops", run["tid"])}
        assert run["pid"] == p.pid
        assert all(r["dur_ns"] > 0 for r in records)
        assert sorted(_match(records, run["times"], offset)) == list(range(CALLS)), "a call without its record"
        assert sum(r["dur_ns"] for r in records) <= run["times"][-1][1] - run["times"][0][0]
        assert values(got, "torch.op_ns", p.pid)["mm"] == sum(r["dur_ns"] for r in records)  # the same durations
        assert values(got, "torch.lost_events", p.pid) == {}

        # on the Chrome trace timeline: one complete event per call, named by its op
        trace = ChromeTrace()
        assert trace.add_calls(records, {p.pid: 0}, host="node-a", source="torch") == CALLS
        events = [e for e in trace.to_json()["traceEvents"] if e["ph"] == "X"]
        assert len(events) == CALLS and {(e["name"], e["cat"], e["tid"]) for e in events} == \
            {("mm", "torch", run["tid"])}
        assert sorted(e["dur"] for e in events) == sorted(r["dur_ns"] / 1000 for r in records)

        # open for part of a round: the calls that returned before the deadline, and no other
        until = time.monotonic_ns() + 500_000_000
        assert tracer.set_detail_until(until) is True
        run = _run_round(ctl, 2)
        got = rows(tracer.sample())
        records = [r for r in tracer.records if r["pid"] == p.pid]
        times = run["times"]
        matched = set(_match(records, times, offset))
        before = {i for i, (t0, t1) in enumerate(times) if t1 < until}
        straddling = {i for i, (t0, t1) in enumerate(times) if t0 <= until <= t1}
        assert before and len(times) > len(before) + 10, "the round did not outlast the open span"
        assert before <= matched <= before | straddling, (len(before), len(matched), len(straddling))
        assert all(r["ts_ns"] - offset + r["dur_ns"] < until for r in records)
        assert values(got, "torch.ops", p.pid)["mm"] == len(times)

        # expired: counted, not recorded
        _run_round(ctl, 3)
        got = rows(tracer.sample())
        assert values(got, "torch.ops", p.pid)["mm"] == CALLS
        assert tracer.records == []

        out, err = p.communicate(timeout=120)
        assert (p.returncode, out) == (untraced.returncode, untraced.stdout), err
        tracer.sample()
        assert tracer.records == [], "the final sum, after the gate closed"
    finally:
        tracer.close()
        if p.poll() is None:
            stop_all([p])


@root
def test_a_torch_tracer_without_detail_mode_sets_no_gate_and_sends_nothing():
    from fleetscope.producers.tracers.torch_ops import TorchTracer
    tracer = TorchTracer("node-a", ops=frozenset({"mm"}))
    try:
        assert tracer.detail is False
        assert tracer.set_detail_until(time.monotonic_ns() + 10**9) is False and tracer.detail_until == 0
        assert tracer.sample() is None and tracer.records == []
    finally:
        tracer.close()


# One rank of a 2-rank gloo job: timed all_reduce calls, CTL/done<rank>.json with the times.
GLOO_RANK = textwrap.dedent("""
    import json, os, sys, threading, time
    import torch
    import torch.distributed as dist
    rank, port, ctl, steps = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.ones(1 << 14)
    dist.all_reduce(t)  # warm-up: connections made before the tracer attaches
    open(os.path.join(ctl, f"ready{rank}"), "w").close()
    while not os.path.exists(os.path.join(ctl, "go")):
        time.sleep(0.005)
    times = []
    for _ in range(steps):
        if rank == 1:
            time.sleep(0.05)  # a straggler: rank 0 waits for it (long beside a loaded scheduler's delays)
        t0 = time.monotonic_ns()
        dist.all_reduce(t)
        times.append((t0, time.monotonic_ns()))
    out = os.path.join(ctl, f"done{rank}.json")
    with open(out + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "tid": threading.get_native_id(), "times": times}, f)
    os.replace(out + ".tmp", out)
    time.sleep(60)
""")
GLOO_STEPS = 10


@root
def test_collective_waits_are_recorded_per_call_with_the_gate_open_from_the_start(tmp_path):
    from fleetscope.producers.tracers.torch_ops import TorchTracer
    script = tmp_path / "gloo_rank.py"
    script.write_text(GLOO_RANK)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**ENV, "GLOO_SOCKET_IFNAME": "lo"}
    procs = [subprocess.Popen(["/usr/bin/python3", str(script), str(r), str(port), str(tmp_path), str(GLOO_STEPS)],
                              env=env) for r in range(2)]
    # detail_always: open from construction, as for anomaly capture; ops probed too (none runs in the timed loop)
    tracer = TorchTracer("node-a", ops=frozenset({"mm"}), detail=True)
    try:
        assert tracer.detail_until == 2**64 - 1
        for r in range(2):
            wait_for(tmp_path / f"ready{r}")
        for p in procs:
            assert tracer.add_pid(p.pid), tracer.unavailable.get(p.pid)
            assert tracer.family_unavailable[p.pid] == {}
        tracer.sample()
        (tmp_path / "go").touch()
        runs = []
        for r in range(2):
            wait_for(tmp_path / f"done{r}.json")
            runs.append(json.loads((tmp_path / f"done{r}.json").read_text()))
        got = rows(tracer.sample())
        records = tracer.records
    finally:
        tracer.close()
        stop_all(procs)
    offset = tracer.clock.offset_ns
    assert {r["family"] for r in records} == {"waits"}  # no op is called in the timed loop
    for p, run in zip(procs, runs):
        mine = [r for r in records if r["pid"] == p.pid]
        work = [r for r in mine if r["api"] == "work"]
        # c10d Work::wait: once per all_reduce, on the calling thread, inside that call
        assert len(work) == GLOO_STEPS and {r["tid"] for r in work} == {run["tid"]}
        assert sorted(_match(work, run["times"], offset)) == list(range(GLOO_STEPS))
        # gloo's waits, on its worker threads: as many records as the rows count, each inside the timed loop
        calls = values(got, "torch.comm_wait_calls", p.pid)
        for kind in ("recv", "send", "work"):
            assert len([r for r in mine if r["api"] == kind]) == calls[kind] > 0, (kind, calls)
        assert sum(r["dur_ns"] for r in mine) == sum(values(got, "torch.comm_wait_ns", p.pid).values())
        lo, hi = run["times"][0][0], run["times"][-1][1]
        assert all(lo <= r["ts_ns"] - offset and r["ts_ns"] - offset + r["dur_ns"] <= hi for r in mine)
    # the straggler's peer waits for it in Work::wait; the straggler finds the data ready
    wait_ms = [sum(r["dur_ns"] for r in records if r["pid"] == p.pid and r["api"] == "work") / 1e6 for p in procs]
    assert wait_ms[0] > 2 * wait_ms[1], wait_ms
