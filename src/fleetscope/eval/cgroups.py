"""Child cgroups for fault injection, on cgroup v2 or on a v1/hybrid host.

A `FaultCgroup` is created as a child of the cgroup the target process is in now
(`<its cgroup>/fleetscope-faults/<name>`), so any limit its container already has still
applies. `add(pid)` moves the process (all its threads), `close()` moves every process back
to where it came from and removes the directory. Nothing is left behind, even when the
caller fails halfway: use it as a context manager, or call close() in a finally.

v2 files: cpu.max, memory.high. v1 equivalents: cpu.cfs_quota_us/cpu.cfs_period_us,
memory.limit_in_bytes (v1 has no memory.high; see faults.MemoryPressure).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

PARENT = "fleetscope-faults"


class CgroupUnavailable(RuntimeError):
    """The controller this fault needs is not mounted here; the message says what was looked for."""


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, options) for every cgroup mount, from /proc/self/mountinfo."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if rfields and rfields[0] in ("cgroup", "cgroup2"):
            opts = set(rfields[2].split(",")) if len(rfields) > 2 else set()
            out.append((fields[4], rfields[0], opts))
    return out


def controller_root(controller: str) -> tuple[Path, int]:
    """(mount point, version) of the hierarchy that owns `controller` (cpu, memory, ...)."""
    v1 = v2 = None
    for mnt, fstype, opts in _mounts():
        if fstype == "cgroup" and controller in opts:
            v1 = Path(mnt)
        elif fstype == "cgroup2":
            ctl = Path(mnt) / "cgroup.controllers"
            if ctl.exists() and controller in ctl.read_text().split():
                v2 = Path(mnt)
    if v2 is not None:
        return v2, 2
    if v1 is not None:
        return v1, 1
    raise CgroupUnavailable(f"no cgroup hierarchy has the {controller!r} controller "
                            f"(cgroup mounts: {[m for m, _, _ in _mounts()]}); this fault cannot be injected here")


def cgroup_of(pid: int, controller: str, version: int) -> str:
    """The pid's cgroup path (relative to the hierarchy root) for that controller."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        hier, ctrls, path = line.split(":", 2)
        if version == 2 and hier == "0":
            return path
        if version == 1 and controller in ctrls.split(","):
            return path
    raise CgroupUnavailable(f"pid {pid} has no {controller} cgroup (v{version}) in /proc/{pid}/cgroup")


class FaultCgroup:
    def __init__(self, controller: str, name: str, pid: int):
        self.controller = controller
        self.root, self.version = controller_root(controller)
        origin = cgroup_of(pid, controller, self.version)
        self.parent = self.root / origin.lstrip("/") / PARENT
        self.path = self.parent / f"{name}-{os.getpid()}"
        self._origins: dict[int, Path] = {}
        self._made_parent = not self.parent.exists()
        self.parent.mkdir(exist_ok=True)
        if self.version == 2:  # a v2 child gets a controller only if its parent delegates it
            for d in (self.parent.parent, self.parent):
                sub = d / "cgroup.subtree_control"
                if controller not in sub.read_text().split():
                    sub.write_text(f"+{controller}")
        self.path.mkdir()

    def write(self, fname: str, value: str) -> None:
        (self.path / fname).write_text(value)

    def read(self, fname: str) -> str:
        return (self.path / fname).read_text().strip()

    def add(self, pid: int) -> None:
        origin = self.root / cgroup_of(pid, self.controller, self.version).lstrip("/")
        (self.path / "cgroup.procs").write_text(str(pid))
        self._origins[pid] = origin

    def pids(self) -> list[int]:
        return [int(p) for p in self.read("cgroup.procs").split()]

    def close(self) -> None:
        """Move every process back where it came from (or to the parent's parent), then rmdir."""
        if not self.path.exists():
            return
        fallback = self.parent.parent
        for pid in self.pids():
            dest = self._origins.get(pid, fallback)
            try:
                (dest / "cgroup.procs").write_text(str(pid))
            except ProcessLookupError:
                pass
        for _ in range(50):  # a process that just exited can linger a moment in the list
            try:
                self.path.rmdir()
                break
            except OSError:
                time.sleep(0.02)
        else:
            raise RuntimeError(f"could not remove {self.path}; processes still in it: {self.pids()}")
        if self._made_parent:
            try:
                self.parent.rmdir()
            except OSError:
                pass  # another fault of ours still uses it

    def __enter__(self) -> "FaultCgroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def memory_charges_move() -> str | None:
    """None if a process moved into a new memory cgroup takes its charged pages along; else why not.

    A memory limit on a fault group presses on a process only through pages charged to that
    group. cgroup v2 never moves charges with a process, and v1 does only through
    memory.move_charge_at_immigrate, which recent kernels refuse (deprecated). Without the
    move, the rank's pages stay charged where they were: the limit squeezes the hog alone and
    the rank runs on untouched (measured here on a 6.18 kernel: no change in its faults or
    steps), so the fault would be a no-op reported as a missed detection."""
    _, version = controller_root("memory")
    if version == 2:
        return "cgroup v2 does not move a process's charged memory into a new group"
    probe = FaultCgroup("memory", "charge-move-probe", os.getpid())
    try:
        probe.write("memory.move_charge_at_immigrate", "3")
    except OSError as e:
        return f"this kernel refuses memory.move_charge_at_immigrate ({e.strerror})"
    finally:
        probe.close()
    return None
