"""TorchTracer on a real PyTorch CPU training loop (torch 2.13.0 CPU build from the venv),
and its collective waits on a real 3-rank torch.distributed gloo job on loopback.

The loops run under Debian's /usr/bin/python3 with the venv's site-packages
on PYTHONPATH (same 3.11 ABI); nothing is stubbed: real libtorch_python and
libtorch_cpu, real gloo over TCP, real uprobes, real eBPF.
"""
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import pytest

from fleetscope.resources import package_dir
from support.batch_rows import rows, stop_all, values, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loading BPF programs needs root (CI runs as root)")

WORKLOAD = package_dir("fleetscope.eval.workloads") / "torch_train.py"
STEPS = 40
# Per step, from the workload's Python code (see its docstring).
PER_STEP = {"linear": 2, "relu": 1, "matmul": 1, "mse_loss": 1, "backward": 1, "add_": 5}


@pytest.fixture
def train(tmp_path):
    procs = []

    def start(steps):
        go = tmp_path / "go"
        env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
        p = subprocess.Popen(["/usr/bin/python3", str(WORKLOAD), str(go), str(steps), "30"], env=env)
        procs.append(p)
        wait_for(f"{go}.ready")  # torch imported, one warm-up step done
        return p, go

    yield start
    stop_all(procs)


@pytest.fixture(scope="module")
def tracer():
    from fleetscope.producers.tracers.torch_ops import TorchTracer
    t = TorchTracer("node-a")
    yield t
    t.close()


def test_op_counts_match_the_training_loop(tracer, train):
    p, go = train(STEPS)
    assert tracer.add_pid(p.pid), tracer.unavailable.get(p.pid)
    tracer.sample()
    go.touch()
    wait_for(f"{go}.done")
    got = rows(tracer.sample())
    ops, ns = values(got, "torch.ops", p.pid), values(got, "torch.op_ns", p.pid)
    assert ops == {op: n * STEPS for op, n in PER_STEP.items()}
    assert all(ns[op] > 0 for op in PER_STEP)
    assert ns["backward"] > ns["relu"]  # the whole backward pass against one relu
    assert all(r["sample_frac"] == pytest.approx(1.0, abs=0.01) for r in got)
    assert tracer.hits()["ops"] >= 2 * sum(PER_STEP.values()) * STEPS  # entry + return


def test_duty_cycling_and_exit(tracer, train):
    p, go = train(0)  # runs until killed
    assert tracer.add_pid(p.pid)
    go.touch()
    time.sleep(0.5)
    t0 = time.monotonic_ns()
    tracer.sample()
    t1 = time.monotonic_ns()
    tracer.set_family_enabled("ops", False)
    t2 = time.monotonic_ns()
    off = tracer.hits()["ops"]
    time.sleep(0.5)
    assert tracer.hits()["ops"] == off  # detached: the loop pays nothing
    t3 = time.monotonic_ns()
    got = rows(tracer.sample())
    # on only between the previous sample and the detach: at most that time over the interval, measured around
    # the calls (on a loaded machine the detach itself can take a good part of a second)
    most = (t2 - t0) / (t3 - t1)
    fracs = [r["sample_frac"] for r in got if r["metric"] == "torch.ops"]
    assert fracs and all(0 < f <= most + 0.01 for f in fracs) and most < 1, (fracs, most)
    tracer.set_family_enabled("ops", True)
    time.sleep(0.5)
    ops = values(rows(tracer.sample()), "torch.ops", p.pid)
    assert ops["linear"] > 0 and abs(ops["linear"] - 2 * ops["relu"]) <= 2
    p.kill()
    p.wait()
    tracer.sample()
    assert p.pid not in tracer.pids
    # the waits are duty-cycled (on a small CPU DDP job they alone are the budget); the marks stay on
    assert tracer.families() == {"ops": "expensive", "waits": "expensive", "collectives": "always"}


def test_process_without_torch_is_refused_with_the_reason(tracer):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)
        assert tracer.add_pid(p.pid) is False
        assert "libtorch_python.so" in tracer.unavailable[p.pid]
        assert "collectives: " in tracer.unavailable[p.pid] and "libtorch_cpu.so" in tracer.unavailable[p.pid]
        assert p.pid not in tracer.pids
    finally:
        p.kill()
        p.wait()


# One rank of a gloo job: all_reduce in a loop, rank SLOW sleeping before each one (a CPU-side straggler).
GLOO_RANK = textwrap.dedent("""
    import os, sys, time
    import torch
    import torch.distributed as dist
    rank, world, port, go, steps, slow, sleep_s = sys.argv[1:]
    rank, world, steps, slow, sleep_s = int(rank), int(world), int(steps), int(slow), float(sleep_s)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    t = torch.ones(1 << 14)
    dist.all_reduce(t)  # warm-up: connections made before the tracer counts
    open(f"{go}.ready{rank}", "w").close()
    while not os.path.exists(go):
        time.sleep(0.01)
    dist.barrier()
    for _ in range(steps):
        if rank == slow:
            time.sleep(sleep_s)
        dist.all_reduce(t)
    open(f"{go}.done{rank}", "w").close()
    time.sleep(60)
""")
GLOO_STEPS, SLOW_RANK, SLEEP_S = 20, 1, 0.05


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_gloo_job(tracer, tmp_path):
    """The 3-rank job above, traced from after its warm-up: (its processes, the rows of its steps, probe
    hits per family during them, the rows of a sample after their last collective)."""
    script, go = tmp_path / "gloo_rank.py", tmp_path / "go"
    script.write_text(GLOO_RANK)
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"], "GLOO_SOCKET_IFNAME": "lo"}
    port = _free_port()
    procs = [subprocess.Popen(["/usr/bin/python3", str(script), str(r), "3", str(port), str(go), str(GLOO_STEPS),
                               str(SLOW_RANK), str(SLEEP_S)], env=env) for r in range(3)]
    try:
        for r in range(3):
            wait_for(f"{go}.ready{r}")
        for p in procs:
            assert tracer.add_pid(p.pid), tracer.unavailable.get(p.pid)
            assert tracer.family_unavailable[p.pid] == {}
        tracer.sample()
        hits0 = tracer.hits()
        go.touch()
        for r in range(3):
            wait_for(f"{go}.done{r}")
        got = rows(tracer.sample())
        hits = {family: n - hits0[family] for family, n in tracer.hits().items()}
        time.sleep(0.3)
        idle = rows(tracer.sample())   # the ranks sleep after their last all_reduce, still traced
    finally:
        stop_all(procs)
    return procs, got, hits, idle


def test_gloo_straggler_makes_its_peers_wait(tracer, tmp_path):
    procs, got, hits, idle = _run_gloo_job(tracer, tmp_path)
    ns = {r: values(got, "torch.comm_wait_ns", p.pid) for r, p in enumerate(procs)}
    calls = {r: values(got, "torch.comm_wait_calls", p.pid) for r, p in enumerate(procs)}
    comm = {r: ns[r]["recv"] + ns[r]["send"] for r in ns}
    print(f"comm wait ms {[round(comm[r] / 1e6) for r in comm]}, work wait ms "
          f"{[round(ns[r]['work'] / 1e6) for r in ns]}, calls {calls}, "
          f"probe hits per rank per step {hits['waits'] / 3 / (GLOO_STEPS + 1):.1f} waits, "
          f"{hits['collectives'] / 3 / (GLOO_STEPS + 1):.1f} marks")
    assert all(calls[r]["work"] == GLOO_STEPS + 1 for r in calls)  # every all_reduce and the barrier, once
    assert all(calls[r]["recv"] > 0 and calls[r]["send"] > 0 for r in calls)
    slept = GLOO_STEPS * SLEEP_S * 1e9
    for peer in (0, 2):  # they wait for the sleeper each step; it finds their data ready
        assert comm[peer] > 0.25 * slept
        assert comm[SLOW_RANK] < 0.5 * comm[peer]
        assert ns[SLOW_RANK]["work"] < 0.5 * ns[peer]["work"]
    assert all(r["sample_frac"] == 1.0 for r in got if r["metric"].startswith("torch.comm_wait"))
    issued = sum(values(got, "torch.coll_issued", p.pid)["gloo0"] for p in procs)
    assert issued == 3 * (GLOO_STEPS + 1)
    # a traced rank that issues no collective says so, a measured 0 (a stuck rank's silence, model/loud.py)
    assert [values(idle, "torch.coll_issued", p.pid) for p in procs] == [{"gloo0": 0}] * 3
    # entry + return per wait, no more: a few dozen per collective, which the governor duty-cycles
    assert hits["waits"] <= 2 * sum(sum(c.values()) for c in calls.values()) + 200
    assert hits["waits"] / 3 / (GLOO_STEPS + 1) < 100
    # the always-on marks: entry + ret of nextTag, two per collective issued, whatever the waits cost
    assert hits["collectives"] == 2 * issued


def test_gloo_marks_number_each_collective_alike_on_every_rank_and_the_sleeper_issues_last(tracer, tmp_path):
    """The arrival marks (producers/tracers/gloo_marks.py): every rank reports the same tags for the job's
    barrier and all_reduces, numbered by the group's own counter although the tracer joined after the
    warm-up all_reduce, and at each all_reduce the rank that slept before it issues it last, about the
    sleep later than its peers, which is what names the culprit (streams/arrival.py)."""
    procs, got, _, _ = _run_gloo_job(tracer, tmp_path)
    marks = {}
    for rank, p in enumerate(procs):
        marks[rank] = {int(d.split("#")[1]): v for d, v in values(got, "torch.coll_entry_ns", p.pid).items()
                       if d.startswith("gloo0#")}
    tags = sorted(marks[0])
    assert len(tags) == GLOO_STEPS + 1 and all(sorted(m) == tags for m in marks.values()), marks
    assert tags == list(range(tags[0], tags[0] + GLOO_STEPS + 1)) and tags[0] >= 1  # after the warm-up's tag
    lags = []
    for tag in tags[1:]:  # the all_reduces (the first tag is the barrier, which nobody sleeps before)
        peers = max(marks[r][tag] for r in (0, 2))
        lags.append((marks[SLOW_RANK][tag] - peers) / 1e9)
    print(f"the sleeper issued each all_reduce {min(lags) * 1e3:.1f}-{max(lags) * 1e3:.1f} ms after its peers")
    assert sum(lag > 0.5 * SLEEP_S for lag in lags) >= 0.9 * len(lags), lags
    now = time.time_ns()
    assert all(now - 120 * 10**9 < v < now for m in marks.values() for v in m.values())  # epoch ns


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build a library without the symbols")
def test_libtorch_cpu_without_the_wait_symbols_gives_the_reason(tracer, tmp_path):
    (tmp_path / "empty.c").write_text("int fleetscope_nothing(void) { return 0; }\n")
    lib = tmp_path / "libtorch_cpu.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "empty.c")], check=True)
    p = subprocess.Popen([sys.executable, "-c", f"import ctypes, time; ctypes.CDLL({str(lib)!r}); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while str(lib) not in Path(f"/proc/{p.pid}/maps").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert tracer.add_pid(p.pid) is False
        why = tracer.unavailable[p.pid]
        assert "exports none of" in why and "UnboundBuffer::waitRecv" in why and "c10d::Work::wait" in why
    finally:
        p.kill()
        p.wait()
