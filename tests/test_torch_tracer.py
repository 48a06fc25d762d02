"""TorchTracer on a real PyTorch CPU training loop (torch 2.13.0 CPU build from the venv).

The loop runs under Debian's /usr/bin/python3 with the venv's site-packages
on PYTHONPATH (same 3.11 ABI); nothing is stubbed: real libtorch_python,
real uprobes, real eBPF.
"""
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from workloads.batch_rows import rows, stop_all, values, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loading BPF programs needs root (CI runs as root)")

WORKLOAD = Path(__file__).parent / "workloads" / "torch_train.py"
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
    from producers.tracers.torch_ops import TorchTracer
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
    tracer.sample()
    tracer.set_family_enabled("ops", False)
    off = tracer.hits()["ops"]
    time.sleep(0.5)
    assert tracer.hits()["ops"] == off  # detached: the loop pays nothing
    got = rows(tracer.sample())
    # on only between the previous sample and the detach: a small fraction of the interval
    assert all(r["sample_frac"] < 0.3 for r in got if r["metric"] == "torch.ops")
    tracer.set_family_enabled("ops", True)
    time.sleep(0.5)
    ops = values(rows(tracer.sample()), "torch.ops", p.pid)
    assert ops["linear"] > 0 and abs(ops["linear"] - 2 * ops["relu"]) <= 2
    p.kill()
    p.wait()
    tracer.sample()
    assert p.pid not in tracer.pids
    assert tracer.families() == {"ops": "expensive"}


def test_process_without_torch_is_refused_with_the_reason(tracer):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)
        assert tracer.add_pid(p.pid) is False
        assert "libtorch_python.so" in tracer.unavailable[p.pid]
    finally:
        p.kill()
        p.wait()
