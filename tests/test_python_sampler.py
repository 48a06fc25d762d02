"""PythonSampler with the real py-spy on real Python processes: the virtualenv's interpreter
(a pyenv build without USDT probes, which the USDT tracer refuses) and Debian's /usr/bin/python3
(with them). Nothing is a stand-in here."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetscope.eval.gpu_stub.batches import index, rows as batch_rows
from fleetscope.eval.workloads import py_calls
from fleetscope.producers.tracers.governor import process_cpu_seconds
from fleetscope.producers.tracers.python_sampler import is_python, parse_raw

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="py-spy reads another process's memory: needs root")

INTERPRETERS = [sys.executable] + (["/usr/bin/python3"] if os.path.exists("/usr/bin/python3") else [])


def test_raw_stacks_become_inclusive_and_self_counts_per_module_function():
    raw = ("<module> (/srv/job/train.py:17);main (/srv/job/train.py:14);step (/srv/job/train.py:7) 30\n"
           "<module> (/srv/job/train.py:17);main (/srv/job/train.py:14);step (/srv/job/train.py:8);"
           "forward (/usr/lib/python3.11/site-packages/torch/nn/modules/module.py:1500) 10\n"
           "<module> (/srv/job/train.py:17);main (/srv/job/train.py:14) 10\n")
    samples, inclusive, own = parse_raw(raw)
    assert samples == 50
    assert inclusive["train:main"] == 50 and inclusive["train:step"] == 40  # each function once per sample
    assert inclusive["torch.nn.modules.module:forward"] == 10
    assert own == {"train:step": 30, "torch.nn.modules.module:forward": 10, "train:main": 10}
    samples, inclusive, own = parse_raw(raw, prefixes=("/srv/job/",))
    assert samples == 50 and "torch.nn.modules.module:forward" not in inclusive
    assert own["train:step"] == 40  # the innermost frame inside the prefixes


@pytest.fixture
def sampler():
    from fleetscope.producers.tracers.python_sampler import PythonSampler
    s = PythonSampler("node-a", rate_hz=49, window_s=1)
    yield s
    s.close()


def _loop(python: str, tmp_path: Path) -> subprocess.Popen:
    """A Python process spinning in py_calls:spin -> middle -> leaf. It never sleeps: on a loaded machine a thread
    that sleeps and wakes waits for a CPU outside the function it woke into, which would move the shares."""
    go = tmp_path / "go"
    go.touch()
    proc = subprocess.Popen([python, py_calls.__file__, str(go), "spin"])
    # in its loop before it is sampled: on a loaded machine the interpreter's start-up (imports, not run())
    # can fill a whole first window; 0.3 s of CPU is far past start-up (about 0.05 s)
    deadline = time.monotonic() + 60
    while process_cpu_seconds([proc.pid]) < 0.3:
        assert proc.poll() is None and time.monotonic() < deadline, "the loop did not start"
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("python", INTERPRETERS)
def test_a_python_process_is_sampled_per_window_with_its_top_functions(sampler, python, tmp_path):
    p = _loop(python, tmp_path)
    try:
        assert sampler.add_pid(p.pid)
        # Beside one busy loop per core py-spy waits for a CPU, and its attach counts against its 1 s --duration:
        # a window then holds 0-4 samples (measured), and a --nonblocking read torn by a preemption misses frames.
        # The shares are checked on the first window that holds at least 10 samples, among the first eight.
        deadline, got, windows = time.monotonic() + 60, None, 0
        while got is None:
            assert time.monotonic() < deadline and windows < 8, f"no window with 10 samples in {windows} windows"
            batch = sampler.sample()
            if batch is not None:
                windows += 1
                rows = index([batch])  # validated against the schema and round-tripped through the wire codec
                assert ("python.samples", "all") in rows and {r["pid"] for r in batch_rows(batch)} == {p.pid}
                if rows[("python.samples", "all")] >= 10:
                    got = batch
            time.sleep(0.1)
        # the loop spends all its time in spin(); <module> is under every stack (a --nonblocking read may miss a frame)
        assert rows[("python.sample_share", "py_calls:<module>")] >= rows[("python.sample_share", "py_calls:spin")] >= 0.5
        top_self = max((v, d) for (m, d), v in rows.items() if m == "python.sample_self_share")
        assert top_self[1] in ("py_calls:spin", "py_calls:middle", "py_calls:leaf"), top_self
        assert {r["pid"] for r in batch_rows(got)} == {p.pid}
        assert p.pid in sampler.pids  # the next window runs
    finally:
        p.kill()
        p.wait()
    deadline = time.monotonic() + 30
    while p.pid in sampler.pids:  # its last window ends with the process; then it is dropped
        assert time.monotonic() < deadline
        sampler.sample()
        time.sleep(0.1)


def test_only_python_processes_are_taken(sampler):
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        assert not is_python(sleeper.pid) and sampler.add_pid(sleeper.pid) is False
        assert is_python(os.getpid())
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_family_off_stops_sampling_and_on_resumes(sampler, tmp_path):
    p = _loop(sys.executable, tmp_path)
    try:
        assert sampler.add_pid(p.pid)
        sampler.set_family_enabled("stacks", False)
        assert sampler.windows[p.pid] is None and sampler.sample() is None
        sampler.set_family_enabled("stacks", True)
        assert sampler.windows[p.pid] is not None
        with pytest.raises(KeyError, match="no family"):
            sampler.set_family_enabled("functions", False)
    finally:
        p.kill()
        p.wait()


def test_a_process_py_spy_cannot_sample_is_set_aside_with_py_spy_s_own_reason(sampler):
    """A Python process that then execs `sleep`: the real py-spy finds no interpreter in it and says so on
    stderr. The sampler keeps that line as the reason, starts no further window, and its files are gone."""
    p = subprocess.Popen([sys.executable, "-c", "import os, sys; sys.stdin.readline(); "
                          "os.execvp('sleep', ['sleep', '60'])"], stdin=subprocess.PIPE)
    try:
        assert sampler.add_pid(p.pid)
        sampler.set_family_enabled("stacks", False)   # no window while it is still Python
        p.stdin.write(b"exec\n")
        p.stdin.flush()
        deadline = time.monotonic() + 20
        while not os.readlink(f"/proc/{p.pid}/exe").endswith("sleep"):
            assert time.monotonic() < deadline, "the process never became sleep"
            time.sleep(0.05)
        sampler.set_family_enabled("stacks", True)
        while p.pid not in sampler.unavailable:
            assert time.monotonic() < deadline + 30, "py-spy's failure was never seen"
            sampler.sample()
            time.sleep(0.1)
        reason = sampler.unavailable[p.pid]
        assert reason == f"py-spy could not sample pid {p.pid}: Error: Failed to find python version from target process"
        assert p.pid not in sampler.windows and list(sampler._dir.iterdir()) == []
    finally:
        p.kill()
        p.wait()
