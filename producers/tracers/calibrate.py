"""Measure what one probe hit costs the traced thread on this host.

A child process calls libc's getppid() in a loop, first untraced, then with
an empty uprobe+uretprobe pair attached to it (pid-filtered, so nothing else
pays). The per-call difference is the cost the governor charges per hit.
Costs depend on the kernel, CPU mitigations and virtualization, so they are
measured, not assumed. Takes well under a second of the child's time plus
one BPF compile.
"""
from __future__ import annotations

import logging
import subprocess
import sys
import time

log = logging.getLogger(__name__)

_CHILD = r"""
import ctypes, sys, time
libc = ctypes.CDLL(None)
f = libc.getppid
n = int(sys.argv[1])
def run():
    t = time.perf_counter_ns()
    for _ in range(n):
        f()
    return (time.perf_counter_ns() - t) / n
run()  # warm up
print(min(run() for _ in range(3)), flush=True)
sys.stdin.readline()  # the parent attaches here
print(min(run() for _ in range(3)), flush=True)
"""

_EMPTY_PAIR = b"""
int on_entry(struct pt_regs *ctx) { return 0; }
int on_return(struct pt_regs *ctx) { return 0; }
"""


def calibrate_hit_cost_ns(calls: int = 20000, timeout_s: float = 60.0) -> float:
    """Nanoseconds one uprobe+uretprobe pair adds to a call (>= 500, a sanity floor)."""
    from bcc import BPF
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(calls)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    bpf = None
    try:
        untraced = float(child.stdout.readline())
        bpf = BPF(text=_EMPTY_PAIR, cflags=["-Wno-everything"])
        libc = _libc_path(child.pid).encode()  # bcc takes bytes (str is deprecated there)
        bpf.attach_uprobe(name=libc, sym=b"getppid", fn_name=b"on_entry", pid=child.pid)
        bpf.attach_uretprobe(name=libc, sym=b"getppid", fn_name=b"on_return", pid=child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        deadline = time.monotonic() + timeout_s
        line = child.stdout.readline()
        if not line or time.monotonic() > deadline:
            raise RuntimeError("calibration child produced no traced timing")
        traced = float(line)
    finally:
        if bpf is not None:
            bpf.cleanup()
        child.kill()
        child.wait()
    cost = traced - untraced
    log.info("probe calibration: %.0f ns untraced, %.0f ns traced: %.0f ns per hit", untraced, traced, cost)
    return max(cost, 500.0)


def _libc_path(pid: int) -> str:
    from fleetscope.producers.tracers.discovery import find_library
    path = find_library(pid, r"/libc\.so\.6$")
    if path is None:
        raise RuntimeError(f"process {pid} maps no libc.so.6")
    return path
