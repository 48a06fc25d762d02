"""KernelTracer's kernel.process_exit rows: how each traced process ended, on real processes with real eBPF.

A crashed rank (killed, a non-zero exit) must read differently from one its launcher stopped (SIGTERM) or one
that finished (exit 0), and the row must still name the rank though the resolver no longer knows the process.
"""
import os
import signal
import subprocess
import sys

import pytest

from fleetscope.producers.identity import IdentityResolver, IdentityRules
from fleetscope.producers.tracers import kernel
from fleetscope.producers.tracers.kernel import btf_member_offset, exit_device
from support.batch_rows import rows
from support.processes import spawn, wait_until  # noqa: F401 (spawn is a fixture)
from support.kernel_tracer import tracer_factory  # noqa: F401 (a fixture)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="loading BPF programs needs root (CI runs as root)")

SLEEPER = "import time; time.sleep(60)"
GATE = "import sys; sys.stdin.read(1); "  # waits for the test's go before it ends on its own
THREADED = ("import threading, time\n"
            "for _ in range(4): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "time.sleep(60)")
# threads that end before their process: none is its last thread, so none makes a row
THREADS_END = ("import threading\n"
               "ts = [threading.Thread(target=sum, args=([1],)) for _ in range(3)]\n"
               "[t.start() for t in ts]; [t.join() for t in ts]\n")


def resolver():
    # the children name their tenant: trusted here (off by default), as in tests/test_kernel_tracer.py
    return IdentityResolver(IdentityRules(tenant_env_trusted=True))


def start(spawn, code, rank, **kw):
    env = {**os.environ, "FLEETSCOPE_TENANT": "t1", "FLEETSCOPE_JOB": "j1", "RANK": str(rank)}
    return spawn(env, [sys.executable, "-c", code], **kw)


def go(proc):
    proc.stdin.write(b"x")
    proc.stdin.close()


def threads(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    except OSError:
        return 0


def proc_state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def exit_rows(got):
    return [r for r in got if r["metric"] == "kernel.process_exit"]


def sample_until(tracer, done, timeout_s=30.0):
    """Sample until `done(rows so far)`; every row sampled, in order."""
    got = []

    def step():
        batch = tracer.sample()
        got.extend(rows(batch) if batch is not None else ())
        return done(got)

    wait_until(step, timeout_s)
    return got


@pytest.mark.parametrize("code, device", [(0, "exit:0"), (3 << 8, "exit:3"), (9, "signal:SIGKILL"),
                                          (15, "signal:SIGTERM"), (0x8B, "signal:SIGSEGV"), (6, "signal:SIGABRT"),
                                          (35, "signal:35")])
def test_exit_device_from_wait_status(code, device):
    assert exit_device(code) == device  # 0x80: core dumped, not part of the device


def test_btf_member_offset(tmp_path):
    if not os.path.exists("/sys/kernel/btf/vmlinux"):
        pytest.skip("this kernel has no BTF (/sys/kernel/btf/vmlinux)")
    exit_code, exit_signal = (btf_member_offset("task_struct", m) for m in ("exit_code", "exit_signal"))
    assert exit_code is not None and exit_signal == exit_code + 4  # adjacent ints in every kernel since 2.6
    assert btf_member_offset("task_struct", "no_such_member") is None
    assert btf_member_offset("task_struct", "exit_code", tmp_path / "missing") is None


@pytest.mark.root
@needs_root
def test_each_way_a_traced_process_ends(spawn, tracer_factory):  # noqa: F811 (a fixture)
    stdin = {"stdin": subprocess.PIPE}
    killed = start(spawn, SLEEPER, 0)  # left unreaped: a zombie, which the resolver no longer knows either
    failed = start(spawn, GATE + "sys.exit(3)", 1, **stdin)
    finished = start(spawn, GATE + THREADS_END, 2, **stdin)
    stopped = start(spawn, SLEEPER, 3)
    threaded = start(spawn, THREADED, 4)
    untraced = start(spawn, SLEEPER, 5)
    expected = {killed.pid: ("signal:SIGKILL", 0), failed.pid: ("exit:3", 1), finished.pid: ("exit:0", 2),
                stopped.pid: ("signal:SIGTERM", 3), threaded.pid: ("signal:SIGKILL", 4)}
    wait_until(lambda: threads(threaded.pid) == 5)
    tracer = tracer_factory(resolver=resolver(), pids=expected)

    killed.kill()
    go(failed)
    go(finished)
    stopped.terminate()
    threaded.kill()
    untraced.kill()
    for p in (failed, finished, stopped, threaded, untraced):
        p.wait(timeout=30)
    got = sample_until(tracer, lambda got: {r["pid"] for r in exit_rows(got)} >= set(expected)
                       and not tracer.pids)
    batch = tracer.sample()  # nothing more comes for them
    got += rows(batch) if batch is not None else []

    ends = exit_rows(got)
    print(f"\nexit rows: {[(r['pid'], r['device'], r['rank']) for r in ends]}")
    assert sorted(r["pid"] for r in ends) == sorted(expected)  # one each: the threaded one too (group_dead)
    assert untraced.pid not in {r["pid"] for r in got}
    for r in ends:
        device, rank = expected[r["pid"]]
        assert (r["device"], r["value"]) == (device, 1.0)
        assert (r["tenant"], r["job"], r["rank"]) == ("t1", "j1", rank)  # remembered: the process is gone
    assert killed.poll() == -signal.SIGKILL  # reaped only now: its row did not wait for the launcher


@pytest.mark.root
@needs_root
def test_last_deltas_go_out_with_the_exit(spawn, tracer_factory):  # noqa: F811 (a fixture)
    # after the go it sleeps once before it exits: its block on stdin began before the tracer was there (no
    # switch-out recorded), so only a switch-out and back in while traced makes off-CPU time
    proc = start(spawn, "print('ready', flush=True); " + GATE + "import time; time.sleep(0.05)", 7,
                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"ready\n"
    wait_until(lambda: proc_state(proc.pid) == "S")  # blocked on its stdin, off the CPU
    tracer = tracer_factory(resolver=resolver(), pids=[proc.pid])
    tracer.sample()  # baseline
    go(proc)  # it wakes, sleeps 50 ms (off-CPU time, counted at its switch-in) and exits 0
    proc.wait(timeout=30)
    got = [r for r in rows(tracer.sample()) if r["pid"] == proc.pid]
    by = {r["metric"]: r for r in got}
    assert by["kernel.process_exit"]["device"] == "exit:0"
    assert by["kernel.offcpu_ns"]["value"] > 0 and by["kernel.ctx_switches"]["value"] > 0
    for r in got:
        assert (r["tenant"], r["job"], r["rank"]) == ("t1", "j1", 7)
    assert proc.pid not in tracer.pids
    batch = tracer.sample()
    assert all(r["pid"] != proc.pid for r in (rows(batch) if batch is not None else []))


@pytest.mark.root
@needs_root
def test_exit_outlives_untracing_before_the_sample(spawn, tracer_factory):  # noqa: F811 (a fixture)
    # The tracer manager untraces a pid once it is gone from /proc, which can be before the tracer's sample.
    ended = start(spawn, SLEEPER, 8)
    alive = start(spawn, GATE + THREADS_END + "print('joined', flush=True); import time; time.sleep(60)", 9,
                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    tracer = tracer_factory(resolver=resolver(), pids=[ended.pid, alive.pid])
    go(alive)
    assert alive.stdout.readline() == b"joined\n"
    wait_until(lambda: threads(alive.pid) == 1)  # its threads have exited, in the kernel too
    ended.kill()
    ended.wait(timeout=30)
    tracer.remove_pid(ended.pid)
    tracer.remove_pid(alive.pid)  # untraced while alive: it has not ended, and its later end is not ours
    alive.kill()
    alive.wait(timeout=30)
    got = exit_rows(rows(tracer.sample()))
    assert [(r["pid"], r["device"], r["tenant"], r["rank"]) for r in got] == \
        [(ended.pid, "signal:SIGKILL", "t1", 8)]
    batch = tracer.sample()
    assert not exit_rows(rows(batch) if batch is not None else [])


@pytest.mark.root
@needs_root
def test_kernel_without_group_dead_traces_on_without_exit_rows(spawn, tracer_factory, tmp_path,  # noqa: F811
                                                                monkeypatch):
    # A tracefs whose sched_process_exit is an older kernel's (no group_dead); bcc attaches to the real one.
    real = next(os.path.join(t, "events") for t in kernel.TRACEFS if os.path.isdir(os.path.join(t, "events")))
    for tp in (*kernel.TRACEPOINTS, kernel.EXIT_TRACEPOINT):
        (tmp_path / "events" / tp).mkdir(parents=True)
    with open(os.path.join(real, kernel.EXIT_TRACEPOINT, "format")) as f:
        older = "".join(line for line in f if "group_dead" not in line)
    (tmp_path / "events" / kernel.EXIT_TRACEPOINT / "format").write_text(older)
    monkeypatch.setattr(kernel, "TRACEFS", (str(tmp_path),))
    proc = start(spawn, SLEEPER, 6)
    tracer = tracer_factory(resolver=resolver(), pids=[proc.pid])
    assert tracer.bpf.num_open_tracepoints() == 3
    proc.kill()
    proc.wait(timeout=30)
    batch = tracer.sample()
    assert proc.pid not in tracer.pids
    assert not exit_rows(rows(batch) if batch is not None else [])
