"""The machinery the CUDA and NCCL tracers share: library uprobes attached per
pid and per probe family, entry/return pairs aggregated in BPF maps
(struct gpu_call_stats in bpf/events.h), and one bulk read per sample.

A subclass names its source, BPF file, libraries and API table, and adds its
own rows (`_extra_rows`) and detail-record decoding (`_decode`).

Per (pid, api) each sample emits <source>.calls, .dur_ns, .errors (deltas),
.bytes (delta, for byte-moving APIs) and .lat_p50_ns/.lat_p99_ns (gauges over
the interval's calls, from a quarter-octave histogram: a reported percentile
is the midpoint of its bucket, within 12.5% of the true value). Every row
carries the fraction of the interval its probe family was attached.
"""
from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass

import numpy as np

from fleetscope.wire import Batch
from producers.tracers.clock import MonotonicClock
from producers.tracers.discovery import find_library
from producers.tracers.kernel import BPF_DIR, TracerUnavailable
from producers.tracers.rows import identity, metric_batch

log = logging.getLogger(__name__)

LAT_BUCKETS = 128  # GPU_LAT_BUCKETS in bpf/events.h
_STATS_HEAD = 4    # calls, dur_ns, errors, bytes precede the histogram


@dataclass(frozen=True)
class Api:
    symbol: str            # exported name in the library
    family: str
    library: str           # key into the tracer's LIBRARIES
    label: str = ""        # the rows' device; defaults to the symbol
    ret: str = "ret_runtime"
    has_bytes: bool = False

    @property
    def device(self) -> str:
        return self.label or self.symbol

    @property
    def entry(self) -> str:
        return f"on_{self.symbol}"


def bucket_value(b: int) -> float:
    """Midpoint (ns) of latency bucket b (see gpu_lat_bucket in bpf/events.h)."""
    octave, sub = b >> 2, b & 3
    if octave < 2:  # values 0..3 have their own buckets; 4..7 are unused
        return float(b)
    return ((4 + sub) << (octave - 2)) + (1 << (octave - 2)) / 2


_BUCKET_MID = np.array([bucket_value(b) for b in range(LAT_BUCKETS)])


def percentile(hist: np.ndarray, q: float) -> float:
    total = hist.sum()
    if total == 0:
        return 0.0
    return float(_BUCKET_MID[int(np.searchsorted(np.cumsum(hist), q * total))])


class GpuCallTracer:
    SOURCE = ""
    BPF_FILE = ""
    LIBRARIES: dict[str, re.Pattern] = {}
    APIS: tuple[Api, ...] = ()
    FAMILIES: dict[str, str] = {}
    PID_MAPS: tuple[str, ...] = ("stats",)  # maps whose keys carry a pid, cleaned on remove_pid

    def __init__(self, host: str, resolver=None, detail: bool = False, ring_pages: int = 1024):
        if os.geteuid() != 0:
            raise TracerUnavailable(f"the {self.SOURCE} tracer loads BPF programs and needs root "
                                    "(or CAP_BPF+CAP_PERFMON): run the agent as root or in a privileged container")
        try:
            from bcc import BPF  # Debian's python3-bpfcc; the PyPI "bcc" is unrelated
        except ImportError as e:
            raise TracerUnavailable(f"bcc is not importable ({e}): install Debian's python3-bpfcc "
                                    "and run install.sh, which links it into the venv") from e
        self.host, self.resolver, self.detail = host, resolver, detail
        self.api_ids = {a.symbol: i for i, a in enumerate(self.APIS)}
        self.family_ids = {f: i for i, f in enumerate(self.FAMILIES)}
        flags = [f"-I{BPF_DIR}", "-Wno-everything", f"-DN_FAMILIES={len(self.FAMILIES)}",
                 f"-DRING_PAGES={ring_pages}"]
        flags += [f"-DAPI_{s}={i}" for s, i in self.api_ids.items()]
        flags += [f"-DFAM_{f}={i}" for f, i in self.family_ids.items()]
        if detail:
            flags.append("-DDETAIL")
        try:
            self.bpf = BPF(text=(BPF_DIR / self.BPF_FILE).read_bytes(), cflags=flags)
        except Exception as e:  # bcc raises bare Exception on compile failure
            raise TracerUnavailable(f"loading bpf/{self.BPF_FILE} failed ({e}); check that kernel headers exist "
                                    f"at /lib/modules/{os.uname().release}/build (install.sh links them)") from e
        self.libs: dict[int, dict[str, str]] = {}       # pid -> library key -> path
        self._attached: set[tuple[int, str]] = set()   # (pid, symbol)
        self.missing_symbols: set[tuple[str, str]] = set()  # (library path, symbol) not exported there
        self._enabled = dict.fromkeys(self.FAMILIES, True)
        mono = time.monotonic_ns()
        self._on_since = dict.fromkeys(self.FAMILIES, mono)
        self._on_ns = dict.fromkeys(self.FAMILIES, 0)
        self._last_mono, self._last_ns = mono, time.time_ns()
        self._prev: dict[tuple[int, int], np.ndarray] = {}
        self._prev_lost = 0
        self.clock = MonotonicClock()
        self.records: list[dict] = []  # detail mode: the calls drained by the latest sample()
        if detail:
            self.bpf[b"calls"].open_ring_buffer(self._on_record)

    # -- targets -------------------------------------------------------------
    def add_pid(self, pid: int) -> bool:
        pid = int(pid)
        found = self._find_libraries(pid)
        if not found:
            log.info("%s tracer: pid %d maps none of %s (yet); not attached", self.SOURCE, pid,
                     ", ".join(rx.pattern for rx in self.LIBRARIES.values()))
            return False
        self.libs[pid] = found
        self._attach_pid(pid)
        return True

    def remove_pid(self, pid: int) -> None:
        pid = int(pid)
        for api in self.APIS:
            self._detach(pid, api)
        self.libs.pop(pid, None)
        for name in self.PID_MAPS:
            table = self.bpf[name.encode()]
            for k in [k for k in table.keys() if _key_pid(k) == pid]:
                try:
                    del table[k]
                except KeyError:
                    pass
        self._prev = {k: v for k, v in self._prev.items() if k[0] != pid}
        self._forget(pid)

    @property
    def pids(self) -> set[int]:
        return set(self.libs)

    def _find_libraries(self, pid: int) -> dict[str, str]:
        return {key: path for key, rx in self.LIBRARIES.items() if (path := find_library(pid, rx))}

    def _attach_pid(self, pid: int) -> None:
        for api in self.APIS:
            if self._enabled[api.family]:
                self._attach(pid, api)

    def _attach(self, pid: int, api: Api) -> None:
        path = self.libs.get(pid, {}).get(api.library)
        if path is None or (pid, api.symbol) in self._attached or (path, api.symbol) in self.missing_symbols:
            return
        try:
            self.bpf.attach_uprobe(name=path.encode(), sym=api.symbol.encode(), fn_name=api.entry.encode(), pid=pid)
        except Exception as e:  # bcc: symbol not found, or the process is gone
            if os.path.exists(f"/proc/{pid}"):
                self.missing_symbols.add((path, api.symbol))
                log.warning("%s tracer: cannot probe %s in %s: %s", self.SOURCE, api.symbol, path, e)
            return
        try:
            self.bpf.attach_uretprobe(name=path.encode(), sym=api.symbol.encode(), fn_name=api.ret.encode(), pid=pid)
        except Exception as e:
            log.warning("%s tracer: cannot probe the return of %s in %s: %s", self.SOURCE, api.symbol, path, e)
            self.bpf.detach_uprobe(name=path.encode(), sym=api.symbol.encode(), pid=pid)
            return
        self._attached.add((pid, api.symbol))

    def _detach(self, pid: int, api: Api) -> None:
        if (pid, api.symbol) not in self._attached:
            return
        self._attached.discard((pid, api.symbol))
        path = self.libs[pid][api.library].encode()
        for detach in (self.bpf.detach_uretprobe, self.bpf.detach_uprobe):
            try:
                detach(name=path, sym=api.symbol.encode(), pid=pid)
            except Exception:  # already gone with its process
                log.debug("detach %s from pid %d", api.symbol, pid, exc_info=True)

    # -- probe families (the governor's controls) ---------------------------
    def families(self) -> dict[str, str]:
        return dict(self.FAMILIES)

    def set_family_enabled(self, family: str, on: bool) -> None:
        if family not in self.FAMILIES:
            raise KeyError(f"{self.SOURCE} has no probe family {family!r}; it has {sorted(self.FAMILIES)}")
        if self._enabled[family] == bool(on):
            return
        mono = time.monotonic_ns()
        if on:
            self._on_since[family] = mono
        else:
            self._on_ns[family] += mono - self._on_since[family]
        self._enabled[family] = bool(on)
        for pid in list(self.libs):
            for api in self.APIS:
                if api.family == family:
                    (self._attach if on else self._detach)(pid, api)

    def hits(self) -> dict[str, int]:
        table = self.bpf[b"hits"]
        return {f: int(table[table.Key(i)].value) for f, i in self.family_ids.items()}

    def attached_probes(self) -> int:
        return len(self._attached)

    # -- sampling -----------------------------------------------------------
    def sample(self, now_ns: int | None = None) -> Batch | None:
        now_ns = time.time_ns() if now_ns is None else int(now_ns)
        mono = time.monotonic_ns()
        interval = max(now_ns - self._last_ns, 0)
        fracs = self._fractions(mono)
        self._last_ns, self._last_mono = now_ns, mono
        # Exits are noted before the maps are read: a process found gone has
        # made its last call, so dropping it after the read loses nothing.
        gone = [pid for pid in self.libs if not os.path.exists(f"/proc/{pid}")]
        rows = self._stats_rows(interval, fracs) + self._extra_rows(interval, fracs)
        if self.detail:
            self.records = []
            self.bpf.ring_buffer_consume()  # all pending records, once
        table = self.bpf[b"lost"]
        lost = int(table[table.Key(0)].value)
        rows.append((f"{self.SOURCE}.lost_events", "all", lost - self._prev_lost, 0, interval, 1.0))
        self._prev_lost = lost
        for pid in gone:
            self.remove_pid(pid)  # its last deltas are in this batch
        for pid in list(self.libs):
            if len(self.libs[pid]) < len(self.LIBRARIES):
                self._pick_up_late_libraries(pid)
        return metric_batch(self.SOURCE, self.host, rows, now_ns, interval, self._identity)

    def _pick_up_late_libraries(self, pid: int) -> None:
        """A process that dlopens another of our libraries later (libcudart loads libcuda on first use)."""
        found = self._find_libraries(pid)
        if len(found) > len(self.libs[pid]):
            self.libs[pid] = {**found, **self.libs[pid]}
            self._attach_pid(pid)

    def _fractions(self, mono: int) -> dict[str, float]:
        span = max(mono - self._last_mono, 1)
        out = {}
        for f in self.FAMILIES:
            on = self._on_ns[f] + (mono - max(self._on_since[f], self._last_mono) if self._enabled[f] else 0)
            out[f] = min(on / span, 1.0)
            self._on_ns[f] = 0
            if self._enabled[f]:
                self._on_since[f] = mono
        return out

    def _stats_rows(self, interval: int, fracs: dict[str, float]) -> list[tuple]:
        rows = []
        src = self.SOURCE
        for k, v in self.bpf[b"stats"].items():
            cur = np.frombuffer(bytes(v), dtype="<u8").astype(np.int64)
            key = (k.pid, k.api)
            prev = self._prev.get(key)
            self._prev[key] = cur
            d = cur if prev is None else cur - prev
            if (d < 0).any():
                d = cur  # the entry was deleted and re-created
            if d[0] == 0:
                continue
            api = self.APIS[k.api]
            frac, pid, dev = fracs[api.family], int(k.pid), api.device
            rows += [(f"{src}.calls", dev, d[0], pid, interval, frac), (f"{src}.dur_ns", dev, d[1], pid, interval, frac),
                     (f"{src}.errors", dev, d[2], pid, interval, frac)]
            if api.has_bytes:
                rows.append((f"{src}.bytes", dev, d[3], pid, interval, frac))
            hist = d[_STATS_HEAD:]
            rows += [(f"{src}.lat_p50_ns", dev, percentile(hist, 0.5), pid, 0, frac),
                     (f"{src}.lat_p99_ns", dev, percentile(hist, 0.99), pid, 0, frac)]
        return rows

    def _sum_rows(self, table: bytes, prev_name: str, label, metric: str, interval: int, fracs) -> list[tuple]:
        """Delta rows of a cumulative (pid, api, sub) -> u64 map, summed by label(key) -> (device, family)."""
        cur = {(int(k.pid), int(k.api), int(k.sub)): int(v.value) for k, v in self.bpf[table].items()}
        prev = getattr(self, prev_name, {})
        setattr(self, prev_name, cur)
        sums: dict[tuple[int, str, str], int] = {}
        for key, value in cur.items():
            d = value - prev.get(key, 0)
            d = value if d < 0 else d
            if d:
                device, family = label(key)
                sums[(key[0], device, family)] = sums.get((key[0], device, family), 0) + d
        return [(metric, dev, d, pid, interval, fracs[fam]) for (pid, dev, fam), d in sums.items()]

    def _extra_rows(self, interval: int, fracs: dict[str, float]) -> list[tuple]:
        return []

    def _forget(self, pid: int) -> None:
        """Subclass hook: drop per-pid user-space state of a removed process."""

    def _on_record(self, ctx, data, size) -> None:
        ev = self.bpf[b"calls"].event(data)
        api = self.APIS[ev.api]
        rec = {"api": api.symbol, "pid": ev.pid, "tid": ev.tid, "ts_ns": self.clock.to_epoch_ns(ev.ts), "dur_ns": ev.dur_ns, "rc": ev.rc}
        rec.update(self._decode(api, int(ev.pid), [int(a) for a in ev.arg]))
        self.records.append(rec)

    def _decode(self, api: Api, pid: int, arg: list[int]) -> dict:
        return {"arg": arg}

    def _identity(self, pid: int):
        return identity(self.resolver, self.host, pid)

    def close(self) -> None:
        bpf, self.bpf = getattr(self, "bpf", None), None
        if bpf is not None:
            bpf.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _key_pid(k) -> int:
    return int(k.pid) if hasattr(k, "pid") else int(k.value)


__all__ = ["Api", "GpuCallTracer", "bucket_value", "percentile"]
