"""The host collector interface and its registry, in the node_exporter style.

Each collector lives in its own module, subclasses `Collector`, and registers
itself with `@register`. Adding a source means adding one file here: the
registry is filled by importing every module in this package, so nothing
else has to change.
"""
from __future__ import annotations

import importlib
import logging
import os
import pkgutil
import stat as _stat
from abc import ABC, abstractmethod
from functools import partial
from typing import ClassVar, Iterable, NamedTuple

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (metric, device)


class Sample(NamedTuple):
    # A tuple, not a dataclass: a tick builds ~100 of these (thousands on a
    # big node), and HostSampler turns them into columns with one zip(*).
    metric: str
    device: str
    value: float
    interval_ns: int  # 0: a gauge; >0: a delta over that many nanoseconds


# Sample(*fields) without the Python-level __new__ of a NamedTuple: the hot
# paths build samples from ready (metric, device, value, interval_ns) tuples.
make_sample = partial(tuple.__new__, Sample)

SLOW_CADENCE_NS = 1_000_000_000  # see Collector.cadence_ns
_READ_CHUNK = 1 << 16
_MAX_KEPT_FDS = 8  # per collector


def _read_all(fd: int) -> bytes:
    """The whole file from offset 0 (procfs can hand it over in pieces)."""
    data = os.pread(fd, _READ_CHUNK, 0)
    if not data:
        return data
    chunk = os.pread(fd, _READ_CHUNK, len(data))
    if not chunk:
        return data
    chunks, offset = [data, chunk], len(data) + len(chunk)
    while chunk:
        chunk = os.pread(fd, _READ_CHUNK, offset)
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class Collector(ABC):
    """One source of host samples. Subclasses set `name` and implement `collect`."""

    name: ClassVar[str]
    default_enabled: ClassVar[bool] = True
    # How often HostSampler runs it: 0 = every tick. Files whose numbers move
    # slowly or matter at window scale (memory, disks, NUMA, vm events,
    # interrupts) run once a second; their counters' deltas then cover that
    # whole second.
    cadence_ns: ClassVar[int] = 0

    def __init__(self, proc_root: str | os.PathLike = "/proc", sys_root: str | os.PathLike = "/sys"):
        # Roots are parameters so tests (and containers that mount the host's
        # /proc elsewhere) can point a collector at another tree.
        self.proc_root = os.fspath(proc_root)
        self.sys_root = os.fspath(sys_root)
        self._warned = False
        self._fds: dict[str, int] = {}  # path -> descriptor kept open between ticks (procfs only)
        self._kernel_devs: frozenset[int] | None = None  # st_dev of proc_root/sys_root if kernel fs roots

    @abstractmethod
    def collect(self, now_ns: int) -> list[Sample]:
        """Counters: the delta since the previous call (nothing on the first).
        Gauges: the current value, every call."""

    def warn_once(self, message: str, *args) -> None:
        # A host that lacks a file lacks it every tick; one line is enough.
        if not self._warned:
            self._warned = True
            log.warning("collector %r: " + message, self.name, *args)

    def read_text(self, path: str) -> str | None:
        """The file's text, or None (after one warning) if it cannot be read."""
        # os.open/os.pread and one decode: about half the CPU of a text-mode
        # open() (no buffered reader, no incremental decoder). procfs files are
        # also kept open between ticks: a read from offset 0 makes the kernel
        # generate them afresh (as top/procps rely on), and it saves the path
        # lookup, open and close per file per tick.
        fd = self._fds.get(path)
        if fd is not None:
            try:
                return _read_all(fd).decode("utf-8", "replace")
            except OSError:  # the kept descriptor went bad; open the path afresh
                del self._fds[path]
                _close_quietly(fd)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            keep = False
            try:
                data = _read_all(fd)
                keep = self._keep_open(path, fd)
            finally:
                if keep:
                    self._fds[path] = fd
                else:
                    os.close(fd)
            return data.decode("utf-8", "replace")
        except OSError as exc:
            self.warn_once("cannot read %s (%s); it reports nothing until the file is readable. "
                           "Disable it by name if this host never has that file.", path, exc.strerror or exc)
            return None

    def _keep_open(self, path: str, fd: int) -> bool:
        # Only files of a real procfs or sysfs under proc_root or sys_root (the
        # root is that filesystem's root, inode 1, and the file lives on it):
        # those are generated by the kernel on each read from offset 0. A
        # regular file (tests, copies) could be replaced by a new one under the
        # same name, so it is reopened each time.
        if self._kernel_devs is None:
            devs = set()
            for root in (self.proc_root, self.sys_root):
                try:
                    st = os.stat(root)
                except OSError:
                    continue
                if st.st_ino == 1:
                    devs.add(st.st_dev)
            self._kernel_devs = frozenset(devs)
        if not self._kernel_devs or len(self._fds) >= _MAX_KEPT_FDS:
            return False
        st = os.fstat(fd)
        return st.st_dev in self._kernel_devs and _stat.S_ISREG(st.st_mode)

    def close(self) -> None:
        """Close the descriptors kept open between ticks (reads reopen them)."""
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            _close_quietly(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def proc(self, *parts: str) -> str:
        return os.path.join(self.proc_root, *parts)

    def sys(self, *parts: str) -> str:
        return os.path.join(self.sys_root, *parts)


class CounterDeltas:
    """Turns successive snapshots of monotonic counters into deltas.

    A key seen in only one of the two snapshots (a CPU that went offline or
    came back, an interface created or removed) and a counter that went
    backwards (a reset or wrap) give no delta that tick: we cannot tell how
    much really happened, and a wrong huge or negative number is worse than
    a gap. The new value still becomes the baseline for the next tick.
    """

    def __init__(self) -> None:
        self._prev: dict[Key, float] | None = None
        self._prev_ns = 0

    def update(self, now_ns: int, current: dict[Key, float]) -> tuple[int, dict[Key, float]]:
        prev, prev_ns = self._prev, self._prev_ns
        self._prev, self._prev_ns = current, now_ns
        if prev is None or now_ns <= prev_ns:  # first call, or the clock stepped back
            return 0, {}
        deltas = {}
        for key, value in current.items():
            old = prev.get(key)
            if old is not None and value >= old:
                deltas[key] = value - old
        return now_ns - prev_ns, deltas

    def samples(self, now_ns: int, current: dict[Key, float], scale: float = 1.0) -> list[Sample]:
        prev, prev_ns = self._prev, self._prev_ns
        self._prev, self._prev_ns = current, now_ns
        if prev is None or now_ns <= prev_ns:  # first call, or the clock stepped back
            return []
        # update()'s rule in one pass, building the samples as it goes.
        interval_ns = now_ns - prev_ns
        get = prev.get
        return [make_sample((key[0], key[1], (value - old) * scale, interval_ns))
                for key, value in current.items()
                if (old := get(key)) is not None and value >= old]


REGISTRY: dict[str, type[Collector]] = {}


def register(cls: type[Collector]) -> type[Collector]:
    """Class decorator: make a collector available to build_collectors by its name."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__qualname__} must set a non-empty class attribute `name` before @register")
    old = REGISTRY.get(name)
    # Re-registering the same class (a module reload) is fine; two classes
    # claiming one name would make config ambiguous.
    if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"collector name {name!r} is taken by {old.__module__}.{old.__qualname__}")
    REGISTRY[name] = cls
    return cls


def load_builtin_collectors() -> None:
    """Import every module of this package, so each collector registers itself."""
    package = __name__.rpartition(".")[0]
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package}.{info.name}")


def build_collectors(enabled: list[str] | None = None, disabled: Iterable[str] = (), *,
                     proc_root: str | os.PathLike = "/proc",
                     sys_root: str | os.PathLike = "/sys") -> list[Collector]:
    """Instantiate collectors by name. `enabled=None` means every default-enabled one."""
    load_builtin_collectors()
    disabled = list(disabled)
    unknown = [n for n in [*(enabled or []), *disabled] if n not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown host collector(s) {unknown}; known: {sorted(REGISTRY)}")
    if enabled is None:
        names = sorted(n for n, cls in REGISTRY.items() if cls.default_enabled)
    else:
        names = list(dict.fromkeys(enabled))  # keep the caller's order, drop repeats
    return [REGISTRY[n](proc_root=proc_root, sys_root=sys_root) for n in names if n not in disabled]
