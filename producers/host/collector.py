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
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Iterable

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (metric, device)


@dataclass(frozen=True, slots=True)
class Sample:
    metric: str
    device: str
    value: float
    interval_ns: int  # 0: a gauge; >0: a delta over that many nanoseconds


class Collector(ABC):
    """One source of host samples. Subclasses set `name` and implement `collect`."""

    name: ClassVar[str]
    default_enabled: ClassVar[bool] = True

    def __init__(self, proc_root: str | os.PathLike = "/proc", sys_root: str | os.PathLike = "/sys"):
        # Roots are parameters so tests (and containers that mount the host's
        # /proc elsewhere) can point a collector at another tree.
        self.proc_root = os.fspath(proc_root)
        self.sys_root = os.fspath(sys_root)
        self._warned = False

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
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError as exc:
            self.warn_once("cannot read %s (%s); it reports nothing until the file is readable. "
                           "Disable it by name if this host never has that file.", path, exc.strerror or exc)
            return None

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
        interval_ns, deltas = self.update(now_ns, current)
        return [Sample(m, d, v * scale, interval_ns) for (m, d), v in deltas.items()]


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
