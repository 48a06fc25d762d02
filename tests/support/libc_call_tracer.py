"""A minimal real tracer for governor tests: an uprobe on libc's getppid, one "expensive" family.

It follows the tracer contract (families, hits counted in BPF,
set_family_enabled really attaching and detaching) on a libc function every
process has, so the governor and manager are tested against real probe
costs on a real process, not a model of them.
"""
from __future__ import annotations

import time

from fleetscope.producers.tracers.discovery import find_library

_PROG = b"""
BPF_ARRAY(hit_count, u64, 1);
int on_call(struct pt_regs *ctx) {
    int zero = 0;
    u64 *n = hit_count.lookup(&zero);
    if (n) __sync_fetch_and_add(n, 1);
    return 0;
}
"""


class LibcCallTracer:
    def __init__(self, host: str = "test", resolver=None):
        from bcc import BPF
        self.bpf = BPF(text=_PROG, cflags=["-Wno-everything"])
        self.pids: dict[int, str] = {}
        self.on = True
        self.on_since = time.monotonic()
        self.on_s = 0.0
        self.toggles = 0
        self.last_hits = 0

    def families(self):
        return {"getppid": "expensive"}

    def hits(self):
        if self.bpf is not None:
            self.last_hits = int(self.bpf[b"hit_count"][0].value)
        return {"getppid": self.last_hits}

    def add_pid(self, pid: int) -> bool:
        libc = find_library(pid, r"/libc\.so\.6$")
        if libc is None:
            return False
        self.pids[pid] = libc
        if self.on:
            self._attach(pid)
        return True

    def remove_pid(self, pid: int) -> None:
        libc = self.pids.pop(pid, None)
        if libc and self.on:
            self.bpf.detach_uprobe(name=libc.encode(), sym=b"getppid", pid=pid)

    def _attach(self, pid):
        self.bpf.attach_uprobe(name=self.pids[pid].encode(), sym=b"getppid", fn_name=b"on_call", pid=pid)

    def set_family_enabled(self, family: str, on: bool) -> None:
        if on == self.on:
            return
        self.toggles += 1
        for pid, libc in self.pids.items():
            if on:
                self._attach(pid)
            else:
                self.bpf.detach_uprobe(name=libc.encode(), sym=b"getppid", pid=pid)
        if not on:
            self.on_s += time.monotonic() - self.on_since
        self.on_since = time.monotonic()
        self.on = on

    def sample(self, now_ns):
        return None

    def close(self):
        self.hits()
        self.bpf.cleanup()
        self.bpf = None
