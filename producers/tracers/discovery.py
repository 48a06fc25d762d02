"""Which processes to trace, and where their libraries are, from /proc alone.

Library paths differ between conda, pip wheels and containers, so nothing is
hard-coded: a process's libraries are read from /proc/<pid>/maps and opened
through /proc/<pid>/root, which reaches a file inside the process's own mount
namespace (a container's /usr/lib is not the host's).
"""
from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

# What "automatic" attaches to: any process that maps one of these.
AUTO_LIBRARIES = {
    "cudart": re.compile(r"/libcudart\.so[.\d]*$"),
    "cuda": re.compile(r"/libcuda\.so[.\d]*$"),
    "nccl": re.compile(r"/libnccl\.so[.\d]*$"),
    "torch_python": re.compile(r"/libtorch_python\.so$"),
    "torch_cpu": re.compile(r"/libtorch_cpu\.so$"),
}


def mapped_objects(pid: int) -> list[str]:
    """Paths of the files a process maps, in first-mapped order, each once. [] if it is gone."""
    seen: dict[str, None] = {}
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith(b"/"):
                    path = parts[5].rstrip(b"\n").decode(errors="replace")
                    if path.endswith(" (deleted)"):
                        continue  # replaced on disk: the old inode is unreachable by path
                    seen.setdefault(path, None)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []
    return list(seen)


def host_path(pid: int, path: str) -> str:
    """The path through which the agent (in the host namespace) reaches a file the process maps."""
    try:
        if os.readlink(f"/proc/{pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt"):
            return path  # same mount namespace: the plain path is the same file
    except OSError:
        pass
    via_root = f"/proc/{pid}/root{path}"
    return via_root if os.path.exists(via_root) else path


def find_library(pid: int, pattern: re.Pattern | str) -> str | None:
    """The process's mapped library matching `pattern`, as a host-reachable path, or None."""
    rx = re.compile(pattern) if isinstance(pattern, str) else pattern
    for path in mapped_objects(pid):
        if rx.search(path):
            return host_path(pid, path)
    return None


def process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def process_cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def library_stamp(pid: int) -> int | None:
    """What changes when a process maps another shared library: its VmLib (kB of library
    code mapped) from /proc/<pid>/status; -1 without one (a kernel thread), None if it is gone.

    A dlopen of libcudart, libnccl or libtorch raises VmLib; heap growth, thread stacks
    and anonymous mappings do not. So a process that was checked and rejected need not have
    its maps (thousands of lines for a PyTorch process) read again until this changes."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmLib:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):   # gone, not ours to read, or a line we cannot parse
        return None
    return -1


def all_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


@dataclass
class TargetSpec:
    """What to trace: explicit pids, a name/cmdline regex, and/or every process mapping AUTO_LIBRARIES."""
    pids: tuple[int, ...] = ()
    name_pattern: str | None = None
    auto: bool = False
    libraries: dict[str, re.Pattern] = field(default_factory=lambda: dict(AUTO_LIBRARIES))

    def matches(self, pid: int) -> bool:
        if pid in self.pids:
            return True
        if self.name_pattern:
            rx = re.compile(self.name_pattern)
            if rx.search(process_name(pid)) or rx.search(process_cmdline(pid)):
                return True
        if self.auto:
            return any(rx.search(p) for p in mapped_objects(pid) for rx in self.libraries.values())
        return False


class ProcessWatcher:
    """Follows the targets over time: `poll()` reports pids that appeared and pids that ended.

    A process that matches only later (it dlopens libcudart after start) is
    reported within ``recheck_s`` of the mapping appearing. One the agent saw
    and rejected is looked at again every ``recheck_s``, and its maps are read
    again only when its library stamp (VmLib) moved: re-reading every process's
    maps on every poll was half of the agent's CPU on a 2-rank PyTorch job
    (py-spy, full tracing), and the stamps of every process every poll the
    largest part of what was left. A new pid is checked on the poll that first
    sees it. A name-pattern spec is re-checked every poll: an exec changes the
    name without always changing VmLib.
    """

    def __init__(self, spec: TargetSpec, exclude: Iterable[int] = (), recheck_s: float = 5.0,
                 clock=time.monotonic):
        self.spec = spec
        self.exclude = {os.getpid(), *exclude}
        self.current: set[int] = set()
        self.recheck_s = recheck_s
        self.clock = clock
        self.rejected: dict[int, tuple[int, float]] = {}   # pid -> (library stamp, when) it did not match

    def _matches(self, pid: int, now: float) -> bool:
        if self.spec.name_pattern or pid in self.spec.pids:
            return self.spec.matches(pid)
        seen = self.rejected.get(pid)
        if seen is not None and now - seen[1] < self.recheck_s:
            return False
        stamp = library_stamp(pid)
        if stamp is None:
            return False
        if seen is not None and seen[0] == stamp:
            self.rejected[pid] = (stamp, now)
            return False
        if self.spec.matches(pid):
            self.rejected.pop(pid, None)
            return True
        self.rejected[pid] = (stamp, now)
        return False

    def poll(self) -> tuple[set[int], set[int]]:
        alive = set(all_pids())
        candidates = (set(self.spec.pids) & alive) if not (self.spec.auto or self.spec.name_pattern) else alive
        now = self.clock()
        found = {pid for pid in candidates - self.exclude - self.current if self._matches(pid, now)}
        ended = self.current - alive
        self.current = (self.current - ended) | found
        for pid in [p for p in self.rejected if p not in alive]:
            del self.rejected[pid]
        return found, ended
