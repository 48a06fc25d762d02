"""ProcessWatcher on real processes: a process that dlopens libcudart after it started is
found on the first poll after the mapping appears, and a rejected process's maps are read
again only when its library stamp (VmLib) moves. The CUDA library is the test stand-in
(src/fleetscope/eval/gpu_stub: no GPU here); the processes, /proc and the dlopen are real.

The late loader dlopens when the test tells it to, not after a timer: with a 400 ms timer the
test failed on a loaded machine, because the first poll (a scan of all of /proc) could end
after the dlopen, and a poll right after the start could see the loader still mapping the
interpreter's own libraries, which moves the stamp too."""
from __future__ import annotations

import subprocess
import sys

import pytest
from fleetscope.eval.gpu_stub.build import build

from fleetscope.producers.tracers import discovery
from fleetscope.producers.tracers.discovery import ProcessWatcher, TargetSpec, library_stamp


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    return build(tmp_path_factory.mktemp("gpu_stub"))


# Everything it maps on its own is mapped before it says "started"; then only the dlopen maps more.
LATE_LOADER = """
import ctypes, sys
print("started", flush=True)
sys.stdin.readline()
ctypes.CDLL(sys.argv[1])
print("loaded", flush=True)
sys.stdin.readline()
"""


class LateLoader:
    def __init__(self, library):
        self.proc = subprocess.Popen([sys.executable, "-c", LATE_LOADER, str(library)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        assert self.proc.stdout.readline() == "started\n"

    def _say(self, expect: str | None) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        if expect:
            assert self.proc.stdout.readline() == expect

    def loaded(self) -> None:
        self._say("loaded\n")

    def finish(self) -> None:
        self._say(None)
        assert self.proc.wait(30) == 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def test_a_late_dlopen_is_found_and_a_rejected_process_is_not_reread(stubs, monkeypatch):
    w = LateLoader(stubs / "libcudart.so.12")
    try:
        reads = []
        real = discovery.mapped_objects
        monkeypatch.setattr(discovery, "mapped_objects", lambda pid: (reads.append(pid), real(pid))[1])
        now = [0.0]
        watcher = ProcessWatcher(TargetSpec(auto=True), recheck_s=5.0, clock=lambda: now[0])
        found, _ = watcher.poll()
        assert w.pid not in found and w.pid in watcher.rejected
        before = library_stamp(w.pid)
        reads.clear()
        for _ in range(3):                                # nothing mapped since: no maps read for it
            now[0] += 6.0
            found, _ = watcher.poll()
            assert w.pid not in found
        assert w.pid not in reads
        w.loaded()                                        # dlopen(libcudart stand-in)
        assert library_stamp(w.pid) > before
        now[0] += 1.0
        found, _ = watcher.poll()
        assert w.pid not in found                         # looked at again only every recheck_s
        now[0] += 5.0
        found, _ = watcher.poll()
        assert w.pid in found and w.pid not in watcher.rejected
        w.finish()
    finally:
        w.kill()
    watcher.poll()
    assert w.pid not in watcher.rejected                  # forgotten once it is gone


def test_library_stamp_of_a_gone_process_and_a_kernel_thread():
    assert library_stamp(2**22 + 12345) is None
    assert library_stamp(2) == -1                         # kthreadd: no VmLib line
