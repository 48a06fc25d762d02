"""The machinery the CUDA and NCCL tracers share: library uprobes attached per
pid and per probe family, entry/return pairs aggregated in BPF maps
(struct gpu_call_stats in bpf/events.h), and one bulk read per sample.

Attaching: per (pid, family, library) two uprobe_multi links (uprobes.py),
one running the BPF entry program `on_call` at each of the family's APIs and
one running `on_return` at their returns; each probe's BPF cookie is the
API's index (bit 63 set for driver calls). Turning a family off or on is a
few link fds closed or opened, for all processes at once: one kernel grace
period, where single perf-event uprobes paid ~0.1 s per probe.

A subclass names its source, BPF file, libraries and API table, and adds its
own rows (`_extra_rows`) and detail-record decoding (`_decode`).

The NCCL and CUDA programs share one map, `nccl_enqueued` (bpf/gpu_calls.bpf.c):
an NCCL call that enqueued work marks its thread, and the CUDA program counts
the thread's next sync call as the wait for it (cuda.nccl_sync_wait_ns). bcc
shares a map between programs of one process by name: `_share_nccl_enqueued`
makes it once per process, in a program of its own that is never unloaded, so
either tracer may load first, alone, or again.

Detail mode (detail=True, -DDETAIL) adds a ring buffer of per-call records, sent only while the BPF
detail gate is open: until a CLOCK_MONOTONIC deadline set by `set_detail_until` (time.monotonic_ns()).
With detail_always (the default) the gate opens for good at construction, as for capture around
anomalies; without, it stays closed until a live capture request opens it for its span. The stats
count every call either way.

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
import threading
import time
from dataclasses import dataclass

import numpy as np

from fleetscope.wire import Batch
from fleetscope.producers.tracers.detail import DETAIL_FOREVER, DetailRecords, detail_flags
from fleetscope.producers.tracers.discovery import find_library
from fleetscope.producers.tracers.duty import DutyClock
from fleetscope.producers.tracers.kernel import BPF_DIR, TracerUnavailable
from fleetscope.producers.tracers.rows import RowIdentity, identity, metric_batch
from fleetscope.producers.tracers.uprobes import Link, LinkSet, check_host, load_multi_program, symbol_offset

log = logging.getLogger(__name__)

LAT_BUCKETS = 128  # GPU_LAT_BUCKETS in bpf/events.h
_STATS_HEAD = 4    # calls, dur_ns, errors, bytes precede the histogram
DRIVER_TAG = 1 << 63  # as in bpf/cuda.bpf.c: a driver call's cookie and in-flight key carry it
NCCL_ENQUEUED_MAX = 65536  # threads with a collective not yet followed by a sync (LRU)
_shared: dict[str, object] = {}
_shared_lock = threading.Lock()


def _share_nccl_enqueued() -> None:
    """Make the map both programs name "extern" (once per process; kept for the process's life)."""
    from bcc import BPF
    with _shared_lock:
        if "nccl_enqueued" not in _shared:
            text = f'BPF_TABLE_SHARED("lru_hash", u64, u64, nccl_enqueued, {NCCL_ENQUEUED_MAX});'
            _shared["nccl_enqueued"] = BPF(text=text.encode(), cflags=["-Wno-everything"])


@dataclass(frozen=True)
class Api:
    symbol: str            # exported name in the library
    family: str
    library: str           # key into the tracer's LIBRARIES
    label: str = ""        # the rows' device; defaults to the symbol
    driver: bool = False   # paired under its own in-flight key (a runtime call may enter the driver)
    has_bytes: bool = False

    @property
    def device(self) -> str:
        return self.label or self.symbol


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


class GpuCallTracer(DetailRecords):
    SOURCE = ""
    BPF_FILE = ""
    LIBRARIES: dict[str, re.Pattern] = {}
    APIS: tuple[Api, ...] = ()
    FAMILIES: dict[str, str] = {}
    # {regex over API symbols: why a uretprobe is safe there}; every API gets one (see uprobes.check_return_probes)
    RETURN_PROBES: dict[str, str] = {}
    PID_MAPS: tuple[str, ...] = ("stats",)  # maps whose keys carry a pid, cleaned on remove_pid

    def __init__(self, host: str, resolver=None, detail: bool = False, ring_pages: int = 1024,
                 detail_always: bool = True):
        check_host(self.SOURCE)
        from bcc import BPF  # Debian's python3-bpfcc; the PyPI "bcc" is unrelated
        self.host, self.resolver, self.detail = host, resolver, detail
        self.api_ids = {a.symbol: i for i, a in enumerate(self.APIS)}
        self.family_ids = {f: i for i, f in enumerate(self.FAMILIES)}
        flags = [f"-I{BPF_DIR}", "-Wno-everything", f"-DN_FAMILIES={len(self.FAMILIES)}",
                 f"-DNCCL_ENQUEUED_MAX={NCCL_ENQUEUED_MAX}", *detail_flags(detail, ring_pages)]
        flags += [f"-DAPI_{s}={i}" for s, i in self.api_ids.items()]
        flags += [f"-DFAM_{f}={i}" for f, i in self.family_ids.items()]
        try:
            _share_nccl_enqueued()
            # the shared pairing code goes in front: bcc rewrites map calls only in the text it is given
            text = (BPF_DIR / "gpu_calls.bpf.c").read_bytes() + (BPF_DIR / self.BPF_FILE).read_bytes()
            self.bpf = BPF(text=text, cflags=flags)
        except Exception as e:  # bcc raises bare Exception on compile failure
            raise TracerUnavailable(f"loading bpf/{self.BPF_FILE} failed ({e}); check that kernel headers exist "
                                    f"at /lib/modules/{os.uname().release}/build (install.sh links them)") from e
        self._prog = {fn: load_multi_program(self.bpf, fn, self.SOURCE) for fn in ("on_call", "on_return")}
        self.libs: dict[int, dict[str, str]] = {}       # pid -> library key -> path
        self.links = LinkSet(self.RETURN_PROBES)        # (pid, family, library key) -> entry + return links
        self._attached: dict[tuple, tuple[str, ...]] = {}  # the same keys -> the symbols they probe
        self.missing_symbols: set[tuple[str, str]] = set()  # (library path, symbol) not exported there
        self._offsets: dict[tuple[str, str], int] = {}  # (library path, symbol) -> file offset
        self._enabled = dict.fromkeys(self.FAMILIES, True)
        self._clock = DutyClock(self.FAMILIES)
        self._last_ns = time.time_ns()
        self._prev: dict[tuple[int, int], np.ndarray] = {}
        self._prev_lost = 0
        self._init_detail(detail, detail_always, self.SOURCE)  # records, the gate, set_detail_until (detail.py)

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
        self._detach([k for k in self._attached if k[0] == pid])
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
        for family, on in self._enabled.items():
            if on:
                self._attach(pid, family)

    def _attach(self, pid: int, family: str) -> None:
        """Links for the family's APIs in each library the process maps (one not yet attached)."""
        for lib, path in self.libs.get(pid, {}).items():
            key = (pid, family, lib)
            if key in self._attached:
                continue
            apis = [(i, a) for i, a in enumerate(self.APIS) if a.family == family and a.library == lib
                    and self._offset(path, a.symbol) is not None]
            if not apis:
                continue
            offsets = tuple(self._offsets[(path, a.symbol)] for _, a in apis)
            cookies = tuple(i | (DRIVER_TAG if a.driver else 0) for i, a in apis)
            try:
                self.links.attach(key, [Link(self._prog["on_call"], path, offsets, cookies),
                                        Link(self._prog["on_return"], path, offsets, cookies, retprobe=True,
                                             symbols=tuple(a.symbol for _, a in apis))], pid)
            except OSError as e:  # the process is gone, or the kernel refused
                if os.path.exists(f"/proc/{pid}"):
                    log.warning("%s tracer: cannot probe %s in %s (pid %d): %s", self.SOURCE, family, path, pid, e)
                continue
            self._attached[key] = tuple(a.symbol for _, a in apis)

    def _offset(self, path: str, symbol: str) -> int | None:
        if (path, symbol) in self.missing_symbols:
            return None
        if (path, symbol) not in self._offsets:
            try:
                self._offsets[(path, symbol)] = symbol_offset(path, symbol)
            except LookupError as e:
                self.missing_symbols.add((path, symbol))
                log.warning("%s tracer: cannot probe %s: %s", self.SOURCE, symbol, e)
                return None
        return self._offsets[(path, symbol)]

    def _detach(self, keys) -> None:
        keys = list(keys)
        for key in keys:
            self._attached.pop(key, None)
        self.links.detach(keys)  # all at once: one shared grace period

    # -- probe families (the governor's controls) ---------------------------
    def families(self) -> dict[str, str]:
        return dict(self.FAMILIES)

    def set_family_enabled(self, family: str, on: bool) -> None:
        if family not in self.FAMILIES:
            raise KeyError(f"{self.SOURCE} has no probe family {family!r}; it has {sorted(self.FAMILIES)}")
        if self._enabled[family] == bool(on):
            return
        self._enabled[family] = bool(on)
        if not on:
            self._clock.set(family, False)  # the probes stop firing early in the detach
            self._detach([k for k in self._attached if k[1] == family])
            return
        for pid in list(self.libs):
            self._attach(pid, family)
        self._clock.set(family, True)

    def hits(self) -> dict[str, int]:
        table = self.bpf[b"hits"]
        return {f: int(table[table.Key(i)].value) for f, i in self.family_ids.items()}

    def attached_probes(self) -> int:
        """Attached entry+return probe pairs (one per API per process)."""
        return sum(len(symbols) for symbols in self._attached.values())

    # -- sampling -----------------------------------------------------------
    def sample(self, now_ns: int | None = None) -> Batch | None:
        now_ns = time.time_ns() if now_ns is None else int(now_ns)
        interval = max(now_ns - self._last_ns, 0)
        fracs = self._clock.fractions()
        self._last_ns = now_ns
        # Exits are noted before the maps are read: a process found gone has
        # made its last call, so dropping it after the read loses nothing.
        gone = [pid for pid in self.libs if not os.path.exists(f"/proc/{pid}")]
        rows = self._stats_rows(interval, fracs) + self._extra_rows(interval, fracs)
        self._drain_records()
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

    def _identity(self, pid: int) :
        return identity(self.resolver, self.host, pid)

    def close(self) -> None:
        if hasattr(self, "links"):
            self.links.close()
            self._attached.clear()
        self._gate = None
        bpf, self.bpf = getattr(self, "bpf", None), None
        if bpf is not None:
            bpf.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _key_pid(k) -> int:
    return int(k.pid) if hasattr(k, "pid") else int(k.value)


__all__ = ["DETAIL_FOREVER", "Api", "GpuCallTracer", "bucket_value", "percentile"]
