"""ProcessSampler: each rank process's own CPU time, faults, context switches, I/O, RSS and threads, from /proc.

The host sampler sees the node as a whole; this one sees the processes of
distributed jobs. Per target process, every tick, it reads

- /proc/<pid>/stat: utime+stime, minflt, majflt, num_threads, rss, and the
  CPU the process (its main thread) last ran on (field 39);
- /proc/<pid>/status: voluntary and involuntary context switches;
- /proc/<pid>/io: read_bytes, write_bytes (the storage layer's bytes).

stat and status are world-readable; io needs ptrace access (the same user, or
root). A process whose io is denied is counted once and its other metrics are
still published. No BPF and no root are needed.

Targets: by default every process whose resolved identity has a rank (a rank
of a distributed job; a torchrun launcher without RANK is not one). When
tracing is pointed at explicit pids or a name pattern (trace_pids,
trace_name), the same targets are sampled instead. /proc is rescanned at most
every `poll_s`; a process that exits is dropped quietly and counted.

Reads happen at most every `min_interval_s` (config proc_interval_s, 1 s, but at least
twice per window), whatever the agent's tick: they cost ~0.3 ms per process (benchmarks/results/process_sampler.json),
2.7% of a core for 8 ranks at a 100 ms tick, and rank windows are seconds long.

Counters go out as deltas since the previous read of that process (interval_ns
= elapsed ns); the first read of a process publishes only the gauges. Rows
carry device `pid<N>` so that a rank's processes stay separate series and the
window can sum them. The last CPU is the exception: row ``proc.last_cpu``,
device ``cpu<N>``, value N (a gauge), so that a window keeps every CPU the
rank was seen on, not only the last; the worker compares them with where the
node's interrupts land (streams/irq_features.py, irq_rank_cpu_share).

Rows carry the process's identity and, for a process in a pod or container,
its placement (pod, namespace, container: Identity.placement()), resolved
once per pid and cached by the resolver; see tracers/rows.py metric_batch.
"""
from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import dataclass
from typing import NamedTuple

from fleetscope.wire import Batch
from fleetscope.producers.tracers.discovery import ProcessWatcher, TargetSpec
from fleetscope.producers.tracers.rows import RowIdentity, identity, metric_batch

log = logging.getLogger(__name__)

SOURCE = "proc"
COUNTERS = ("proc.cpu_ns", "proc.minflt", "proc.majflt", "proc.vol_ctx", "proc.invol_ctx")
IO_COUNTERS = ("proc.read_bytes", "proc.write_bytes")
NS_PER_TICK = 1e9 / os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
FORGET_EVERY_S = 60.0  # how often the resolver's cache of non-target pids is pruned

_GONE = (errno.ENOENT, errno.ESRCH)
_STATUS_KEYS = (b"voluntary_ctxt_switches", b"nonvoluntary_ctxt_switches")
_IO_KEYS = (b"read_bytes", b"write_bytes")


class Vanished(Exception):
    """The process exited (or is a zombie)."""


class Reading(NamedTuple):
    starttime: int  # clock ticks since boot: tells a reused pid from the process it replaced
    counters: tuple[float, ...]  # in COUNTERS order
    io: tuple[float, float] | None  # read_bytes, write_bytes; None when /proc/<pid>/io is denied
    rss_bytes: float
    threads: float
    last_cpu: int  # the CPU the main thread last ran on (field 39 of stat)


def read_file(path: str) -> bytes:
    """The whole (small) /proc file, in one read where it fits."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.read(fd, 8192)
        if len(data) == 8192:
            parts = [data]
            while chunk := os.read(fd, 8192):
                parts.append(chunk)
            data = b"".join(parts)
        return data
    finally:
        os.close(fd)


def parse_stat(raw: bytes) -> tuple[int, float, float, float, float, float, int]:
    """(starttime, cpu_ns, minflt, majflt, threads, rss_pages, last_cpu) of a /proc/<pid>/stat line.

    comm may hold spaces and ')', so the fields are split after the last ')'.
    Raises Vanished for a zombie or dead process."""
    fields = raw[raw.rindex(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):
        raise Vanished
    # fields[0] is field 3 of proc(5): minflt 10, majflt 12, utime 14, stime 15, num_threads 20,
    # starttime 22, rss 24, processor 39
    return (int(fields[19]), (int(fields[11]) + int(fields[12])) * NS_PER_TICK, float(fields[7]),
            float(fields[9]), float(fields[17]), float(fields[21]), int(fields[36]))


def process_cpu_ns(pid: int) -> float:
    """The process's user+system CPU time so far (all its threads), in ns. Raises OSError or Vanished when it is
    gone."""
    return parse_stat(read_file(f"/proc/{pid}/stat"))[1]


def parse_keyed(raw: bytes, keys: tuple[bytes, ...]) -> list[float]:
    """Values of `keys` ("name:  value" lines), in order; KeyError if one is missing.

    Finds each line rather than splitting the file: status has ~55 lines and we want two."""
    text = b"\n" + raw
    out = []
    for key in keys:
        at = text.find(b"\n" + key + b":")
        if at < 0:
            raise KeyError(key.decode())
        start = at + len(key) + 2
        out.append(float(text[start:text.find(b"\n", start)]))
    return out


@dataclass
class RankTargets(TargetSpec):
    """Every process whose resolved identity has a rank (rank >= 0). Scans all of /proc like `auto`."""

    resolver: object = None
    auto: bool = True  # every live pid is a candidate

    def matches(self, pid: int) -> bool:
        ident = self.resolver.resolve(pid) if self.resolver is not None else None
        return ident is not None and ident.rank is not None and ident.rank >= 0


class ProcessSampler:
    name = "proc"

    def __init__(self, host: str, resolver, targets: TargetSpec | None = None, poll_s: float = 1.0,
                 proc_root: str = "/proc", clock=time.monotonic, min_interval_s: float = 0.0):
        self.host = host
        self.resolver = resolver
        self.targets = targets if targets is not None else RankTargets(resolver=resolver)
        self.watcher = ProcessWatcher(self.targets)
        self.poll_s = poll_s
        self.proc_root = proc_root
        self.clock = clock
        self.min_interval_s = min_interval_s
        self._last_read: float | None = None
        self._last_poll: float | None = None
        self._last_forget = clock()
        self._prev: dict[int, tuple[int, Reading]] = {}  # pid -> (ts_ns, reading)
        self._io_denied: set[int] = set()
        self.read_errors = 0
        self.vanished = 0
        self.io_denied = 0

    @classmethod
    def from_config(cls, cfg, resolver) -> "ProcessSampler":
        """Tracing's explicit targets when configured, else every rank process."""
        targets = None
        if cfg.trace_pids or cfg.trace_name:
            targets = TargetSpec(pids=tuple(int(p) for p in cfg.trace_pids), name_pattern=cfg.trace_name)
        # at least twice a window: a window without proc rows would have those features masked, and a job's
        # windows alternating between two feature sets score unlike each other (the CI scenario, 0.5 s windows)
        every = min(cfg.proc_interval_s, cfg.window_s / 2)
        return cls(cfg.host, resolver, targets=targets, poll_s=cfg.trace_poll_s, min_interval_s=every)

    def stats(self) -> dict:
        return {"proc_pids": len(self.watcher.current), "proc_read_errors": self.read_errors,
                "proc_vanished": self.vanished, "proc_io_denied": self.io_denied}

    def close(self) -> None:
        pass  # it holds no descriptors or threads between ticks

    def sample(self, now_ns: int | None = None) -> Batch | None:
        now_ns = time.time_ns() if now_ns is None else int(now_ns)
        t = self.clock()
        # 0.9: a drift-free 1 s tick must not skip every other read for a few ms of jitter
        if self._last_read is not None and t - self._last_read < 0.9 * self.min_interval_s:
            return None
        self._last_read = t
        self._poll()
        rows: list[tuple] = []  # (metric, device, value, pid, interval_ns, sample_frac)
        for pid in sorted(self.watcher.current):
            try:
                reading = self.read(pid)
            except Vanished:
                self._drop(pid)
                continue
            except (OSError, ValueError, IndexError, KeyError) as e:
                self.read_errors += 1
                log.debug("proc: /proc/%d unreadable: %s", pid, e)
                continue
            prev = self._prev.get(pid)
            if prev is not None and prev[1].starttime != reading.starttime:
                self._drop(pid)  # the pid now names another process: the next scan decides on it
                continue
            self._prev[pid] = (now_ns, reading)
            dev = f"pid{pid}"
            rows += [("proc.rss_bytes", dev, reading.rss_bytes, pid, 0, 1.0),
                     ("proc.threads", dev, reading.threads, pid, 0, 1.0),
                     ("proc.last_cpu", f"cpu{reading.last_cpu}", float(reading.last_cpu), pid, 0, 1.0)]
            interval = now_ns - prev[0] if prev is not None else 0
            if interval <= 0:
                continue  # first read: gauges only
            old = prev[1]
            pairs = list(zip(COUNTERS, reading.counters, old.counters))
            if reading.io is not None and old.io is not None:
                pairs += zip(IO_COUNTERS, reading.io, old.io)
            rows += [(name, dev, max(cur - was, 0.0), pid, interval, 1.0) for name, cur, was in pairs]
        if not rows:
            return None
        return metric_batch(SOURCE, self.host, rows, now_ns, 0, self._identity)

    def read(self, pid: int) -> Reading:
        """One process's counters and gauges. Raises Vanished once it is gone."""
        base = f"{self.proc_root}/{pid}/"
        try:
            starttime, cpu_ns, minflt, majflt, threads, rss_pages, last_cpu = parse_stat(read_file(base + "stat"))
            vol, invol = parse_keyed(read_file(base + "status"), _STATUS_KEYS)
        except OSError as e:
            if e.errno in _GONE:
                raise Vanished from None
            raise
        return Reading(starttime, (cpu_ns, minflt, majflt, vol, invol), self._read_io(pid, base),
                       rss_pages * PAGE_SIZE, threads, last_cpu)

    def _read_io(self, pid: int, base: str) -> tuple[float, float] | None:
        if pid in self._io_denied:
            return None
        try:
            read_bytes, write_bytes = parse_keyed(read_file(base + "io"), _IO_KEYS)
        except PermissionError:
            self._io_denied.add(pid)  # counted once per process; retrying would fail every tick
            self.io_denied += 1
            return None
        except OSError as e:
            if e.errno in _GONE:
                raise Vanished from None
            raise
        return read_bytes, write_bytes

    def _poll(self) -> None:
        now = self.clock()
        if self._last_poll is not None and now - self._last_poll < self.poll_s:
            return
        self._last_poll = now
        _, ended = self.watcher.poll()
        for pid in ended:
            self._drop(pid, from_watcher=False)
        if self.resolver is not None and now - self._last_forget >= FORGET_EVERY_S:
            self._last_forget = now
            self.resolver.forget_dead()  # non-targets are resolved on every scan and cached

    def _drop(self, pid: int, from_watcher: bool = True) -> None:
        self.vanished += 1
        self._prev.pop(pid, None)
        self._io_denied.discard(pid)
        if from_watcher:
            self.watcher.current.discard(pid)

    def _identity(self, pid: int) :
        return identity(self.resolver, self.host, pid)


def build_source(cfg, new_resolver, publish) -> ProcessSampler:
    """The agent's proc source: it reads /proc only, so it runs without root."""
    return ProcessSampler.from_config(cfg, new_resolver())
