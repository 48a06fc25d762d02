"""The installer's eBPF half works: bcc imports in the venv, compiles against the
kernel headers it linked, and a real tracepoint fires for a real process."""
import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loading BPF programs needs root (CI runs as root)")

PROGRAM = r"""
BPF_HASH(switches, u32, u64);
TRACEPOINT_PROBE(sched, sched_switch) {
    u32 pid = args->prev_pid;
    if (pid != TARGET_PID) return 0;
    switches.increment(pid);
    return 0;
}
"""


def test_bcc_compiles_and_counts_context_switches_of_a_real_process():
    from bcc import BPF  # Debian's bcc, linked into the venv by install.sh

    # the sleeper waits for a go on stdin, so its sleeps happen after the probe is attached
    sleeper = subprocess.Popen([sys.executable, "-c", "import sys, time\nsys.stdin.readline()\n"
                                "for _ in range(40): time.sleep(0.01)"], stdin=subprocess.PIPE)
    try:
        bpf = BPF(text=PROGRAM.replace("TARGET_PID", str(sleeper.pid)).encode(), cflags=["-Wno-everything"])
        sleeper.communicate(b"go\n", timeout=10)
        time.sleep(0.1)
        counts = {k.value: v.value for k, v in bpf[b"switches"].items()}
        bpf.cleanup()
    finally:
        sleeper.kill()
    # each sleep(0.01) switches the process off the CPU at least once
    assert counts.get(sleeper.pid, 0) >= 20


def test_kernel_headers_are_where_bcc_looks():
    build = f"/lib/modules/{os.uname().release}/build"
    assert os.path.exists(os.path.join(build, "Makefile")), f"{build} missing: run install.sh as root"
    assert os.path.ismount("/sys/kernel/tracing") or os.path.isdir("/sys/kernel/tracing/events")
