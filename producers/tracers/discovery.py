"""Which processes to trace, and where their libraries are, from /proc alone.

Library paths differ between conda, pip wheels and containers, so nothing is
hard-coded: a process's libraries are read from /proc/<pid>/maps and opened
through /proc/<pid>/root, which reaches a file inside the process's own mount
namespace (a container's /usr/lib is not the host's).
"""
from __future__ import annotations

import os
import re
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
    reported on the first poll after the mapping appears; one the agent saw
    and rejected is re-checked every poll, which costs one maps read each.
    """

    def __init__(self, spec: TargetSpec, exclude: Iterable[int] = ()):
        self.spec = spec
        self.exclude = {os.getpid(), *exclude}
        self.current: set[int] = set()

    def poll(self) -> tuple[set[int], set[int]]:
        alive = set(all_pids())
        candidates = (set(self.spec.pids) & alive) if not (self.spec.auto or self.spec.name_pattern) else alive
        found = {pid for pid in candidates - self.exclude - self.current if self.spec.matches(pid)}
        ended = self.current - alive
        self.current = (self.current - ended) | found
        return found, ended
