"""NvmlSampler: read every GPU through NVML once per tick into one "nvml" batch.

Device rows carry the node identity and the GPU index; per-process rows carry
the identity that `resolver.resolve(pid)` gives (an object with tenant, job
and rank, and its placement(): pod, namespace, container), or the node identity
with the pid when it gives none. The placement columns come only with process
rows that have one; device rows leave them '' (the batch omits them when no row
has one). Metrics and units are listed in producers/nvml/__init__.py.

Nothing here crashes the agent. Each degradation gets one log line and one
status row, and the rest keeps sampling:
  - NVML library missing or nvmlInit failing: a status row (nvml.status,
    device "library" or "init", value 0) once, then sample() returns None;
  - no GPU: nvml.status / "no_gpu", then None;
  - a call a GPU or driver does not support: nvml.unsupported /
    "gpu<N>:<field>", and that field is skipped on that GPU from then on;
  - a GPU lost mid-run: nvml.gpu_lost / "gpu<N>" value 1, and that GPU is not
    queried again while the others continue.
Any other NVMLError is counted in `errors[field]` and skips that field for
this tick only.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import pynvml

from fleetscope.schema import NO_GPU, NO_RANK, NODE_TENANT, PLACEMENT_COLUMNS, SOURCE_COLUMNS
from fleetscope.wire import Batch
from fleetscope.producers.host.columns import BatchIds, NodeIdentityColumns, RepeatingColumn, str_column
from fleetscope.producers.nvml.calls import DeviceCalls, EntryPoints
from fleetscope.producers.nvml.device_metrics import STATIC_FIELDS, THROTTLE_METRICS, TICK_FIELDS, decode_throttle
from fleetscope.producers.nvml.energy import split_energy
from fleetscope.producers.nvml.field_batch import FieldBatch
from fleetscope.producers.nvml.gpm import TENSOR_METRIC, GpmReader, gpm_supported, ofu_percent
from fleetscope.producers.nvml.library import NvmlUnavailable, close_nvml, open_nvml

log = logging.getLogger(__name__)

_UNSUPPORTED = {pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND}
# A field id this driver does not know comes back as INVALID_ARGUMENT: for a field, that is "unsupported".
_FIELD_UNSUPPORTED = _UNSUPPORTED | {pynvml.NVML_ERROR_INVALID_ARGUMENT}
_DUE_SLACK = 0.95  # a group is due once 95% of its interval has passed (tick jitter)

# Cadence groups (see device_metrics.py).
TICK, SLOW, STATIC, PCIE, GPM = "tick", "slow", "static", "pcie", "gpm"


def _one(read):
    return lambda c: (float(read(c)),)


# Single-call readings: (name, cadence group, metrics, reader(calls) -> values).
# Utilization comes first: it is the cheapest call, and the first to report a
# GPU that has fallen off the bus. The TICK getters come first, in the order
# of DeviceCalls.tick(), which reads them all in one go (see _sample_getters).
GETTERS = (
    ("utilization", TICK, ("nvml.gpu_util", "nvml.mem_util"), lambda c: c.utilization()),
    ("memory", TICK, ("nvml.mem_used",), lambda c: c.memory()[:1]),
    ("sm_clock", TICK, ("nvml.sm_clock_mhz",), _one(lambda c: c.clock(pynvml.NVML_CLOCK_SM))),
    ("mem_clock", TICK, ("nvml.mem_clock_mhz",), _one(lambda c: c.clock(pynvml.NVML_CLOCK_MEM))),
    ("throttle", TICK, THROTTLE_METRICS, lambda c: decode_throttle(c.throttle())),
    ("temperature", SLOW, ("nvml.temp_c",),
     _one(lambda c: c.uint("nvmlDeviceGetTemperature", pynvml.NVML_TEMPERATURE_GPU))),
    ("memory_total", STATIC, ("nvml.mem_total",), lambda c: c.memory()[1:]),
    ("sm_clock_max", STATIC, ("nvml.sm_clock_max_mhz",),
     _one(lambda c: c.uint("nvmlDeviceGetMaxClockInfo", pynvml.NVML_CLOCK_SM))),
    ("mem_clock_max", STATIC, ("nvml.mem_clock_max_mhz",),
     _one(lambda c: c.uint("nvmlDeviceGetMaxClockInfo", pynvml.NVML_CLOCK_MEM))),
    ("pcie_tx", PCIE, ("nvml.pcie_tx_kbps",),
     _one(lambda c: c.uint("nvmlDeviceGetPcieThroughput", pynvml.NVML_PCIE_UTIL_TX_BYTES))),
    ("pcie_rx", PCIE, ("nvml.pcie_rx_kbps",),
     _one(lambda c: c.uint("nvmlDeviceGetPcieThroughput", pynvml.NVML_PCIE_UTIL_RX_BYTES))),
)
_TICK_GETTERS = frozenset(name for name, group, _, _ in GETTERS if group == TICK)
_TICK_METRICS = tuple(m for name, _, metrics, _ in GETTERS if name in _TICK_GETTERS for m in metrics)
assert all(group == TICK for _, group, _, _ in GETTERS[:len(_TICK_GETTERS)]), "TICK getters lead GETTERS"
_TICK_ONLY = ({TICK: True, SLOW: False, STATIC: False, PCIE: False, GPM: False},
              [getter for getter in GETTERS if getter[1] == TICK])


@dataclass
class _Device:
    index: int
    calls: DeviceCalls | None
    lost: bool = False
    unsupported: set[str] = field(default_factory=set)
    fields: dict = field(default_factory=dict)  # cadence group -> FieldBatch
    gpm: GpmReader | None = None
    clock_sum: float = 0.0             # SM clock summed over the ticks since the last GPM read, for OFU
    clock_n: int = 0
    sm_clock_max: float | None = None  # kept between static reads, for OFU
    energy_j: float = 0.0              # device energy since the last per-process split
    energy_ns: int = 0                 # ... and the time those deltas cover
    last_putil_us: int = 0  # NVML's lastSeenTimeStamp for process-utilization samples

    label: str = ""

    def __post_init__(self) -> None:
        self.label = f"gpu{self.index}"

    @property
    def handle(self):
        return self.calls.handle if self.calls is not None else None


class _Rows:
    """One tick's rows: node-identity rows, then per-process rows.

    Node rows come in runs of one device's readings: `layout` holds one
    (metrics, device, gpu) per run, and only the values and intervals are
    flat lists. The metric, device and gpu columns follow from the layout,
    which repeats from tick to tick (see _Columns), so a tick does not spell
    them out row by row; comparing two layouts is a few pointer compares a
    run, as the metric tuples are mostly the same objects every tick."""

    __slots__ = ("layout", "value", "interval", "procs")

    def __init__(self):
        self.layout: list[tuple[tuple, str, int]] = []
        self.value: list[float] = []
        self.interval: list[int] = []
        # (metric, device, value, interval_ns, gpu, pid, tenant, job, rank, pod, namespace, container)
        self.procs: list[tuple] = []

    def add(self, dev: _Device, metrics: tuple, values, intervals=None) -> None:
        self.layout.append((metrics, dev.label, dev.index))
        self.value += values
        self.interval += intervals if intervals is not None else [0] * len(metrics)

    def __len__(self) -> int:
        return len(self.value) + len(self.procs)


class NvmlSampler:
    name = "nvml"

    def __init__(self, host: str, resolver=None, library_path: str | None = None,
                 pcie_min_interval_ns: int = 1_000_000_000, slow_interval_ns: int = 1_000_000_000,
                 static_interval_ns: int = 10_000_000_000, gpm_interval_ns: int = 1_000_000_000):
        self.host = host
        self.resolver = resolver
        self.intervals = {TICK: 0, SLOW: int(slow_interval_ns), STATIC: int(static_interval_ns),
                          PCIE: int(pcie_min_interval_ns), GPM: int(gpm_interval_ns)}
        self.errors: dict[str, int] = {}
        self._pending: list[tuple] = []  # status rows for the next batch: (metric, device, value, gpu)
        self._devices: list[_Device] = []
        self._last_read: dict[str, int] = {}  # cadence group -> ns of its last read
        self._quiet_until = 0  # until then, only the TICK group is due (see _due)
        self._active = False
        self._opened = False
        self._columns = _Columns(host)
        try:
            open_nvml(library_path)
            self._opened = True
            count = pynvml.nvmlDeviceGetCount()
        except NvmlUnavailable as exc:
            log.warning("NVML unavailable, GPU telemetry is off on %s: %s", host, exc)
            self._status("nvml.status", exc.what, 0.0)
            return
        except pynvml.NVMLError as exc:
            log.error("NVML could not count GPUs on %s (%s); GPU telemetry is off", host, exc)
            self._status("nvml.status", "init", 0.0)
            return
        if count == 0:
            log.warning("NVML sees no GPU on %s; GPU telemetry is off (is this a GPU node?)", host)
            self._status("nvml.status", "no_gpu", 0.0)
            return
        entry = EntryPoints()
        for index in range(count):
            self._open_device(index, entry)
        self._active = True

    def _open_device(self, index: int, entry: EntryPoints) -> None:
        try:
            calls = DeviceCalls(pynvml.nvmlDeviceGetHandleByIndex(index), entry)
        except pynvml.NVMLError as exc:
            dev = _Device(index, None)
            self._on_error(dev, "handle", exc)
            if not dev.lost:
                log.error("GPU %d has no NVML handle (%s); it will not be sampled", index, exc)
            return
        dev = _Device(index, calls)
        for group, specs in ((TICK, TICK_FIELDS), (STATIC, STATIC_FIELDS)):
            try:
                dev.fields[group] = FieldBatch(specs, entry)
            except pynvml.NVMLError as exc:  # no nvmlDeviceGetFieldValues at all: an old driver
                self._on_error(dev, f"fields.{group}", exc)
        self._devices.append(dev)

    def sample(self, now_ns: int | None = None) -> Batch | None:
        """One batch of every GPU's readings at now_ns, or None if there are none."""
        now_ns = time.time_ns() if now_ns is None else int(now_ns)
        rows = _Rows()
        if self._active:
            identities: dict[int, tuple] = {}
            due, getters = self._due(now_ns)
            for dev in self._devices:
                if not dev.lost:
                    self._sample_device(dev, now_ns, due, getters, rows, identities)
        # Status found during this tick (and at start-up) leads this tick's batch.
        pending, self._pending = self._pending, []
        return self._columns.batch(pending, rows, now_ns) if (rows or pending) else None

    def stats(self) -> dict:
        return {}  # failures travel as nvml.status / nvml.unsupported / nvml.gpu_lost rows in the batch itself

    def close(self) -> None:
        for dev in self._devices:
            if dev.gpm is not None:
                dev.gpm.close()
        self._devices, self._active = [], False
        if self._opened:
            close_nvml()
            self._opened = False

    # -- one device --------------------------------------------------------

    def _due(self, now_ns: int) -> tuple[dict[str, bool], list]:
        """Which cadence groups this tick reads, and the GETTERS among them (the same for every GPU).

        Most ticks read the TICK group only: until the first slower group
        comes due (and unless the clock went back), that answer is kept."""
        last_read = self._last_read
        if last_read.get(TICK, now_ns + 1) <= now_ns < self._quiet_until:
            last_read[TICK] = now_ns
            return _TICK_ONLY
        due = {}
        for group, interval in self.intervals.items():
            last = last_read.get(group)
            due[group] = last is None or now_ns - last >= interval * _DUE_SLACK
            if due[group]:
                last_read[group] = now_ns
        self._quiet_until = min((last_read[group] + interval * _DUE_SLACK
                                 for group, interval in self.intervals.items() if group != TICK), default=0)
        return due, [getter for getter in GETTERS if due[getter[1]]]

    def _sample_device(self, dev: _Device, now_ns: int, due: dict, getters: list, rows: _Rows,
                       identities: dict) -> None:
        """`getters`: the GETTERS due this tick."""
        unsupported = dev.unsupported
        if not self._sample_getters(dev, getters, rows):  # the GPU is lost
            return
        for group, batch in dev.fields.items():
            if due[group] and batch.specs:
                self._sample_fields(dev, group, batch, now_ns, rows)
                if dev.lost:
                    return
        if due[GPM] and "gpm" not in unsupported:
            self._sample_gpm(dev, rows)
        if due[SLOW] and not dev.lost:
            self._sample_processes(dev, rows, identities)

    def _sample_getters(self, dev: _Device, getters: list, rows: _Rows) -> bool:
        """This tick's getters into `rows`; False if the GPU turned out lost.

        The usual tick takes the TICK getters in one DeviceCalls.tick() call:
        one Python call for five C calls, where a getter each costs a few
        Python frames, which on 8 GPUs at 10 ticks a second cost more than the
        C calls. Any failure there, or a TICK getter this GPU does not
        support, sends the tick getter by getter, which says which failed."""
        raw = dev.calls.tick() if dev.unsupported.isdisjoint(_TICK_GETTERS) else None
        if raw is None:
            slower = getters
        else:
            gpu_util, mem_util, mem_used, sm_clock, mem_clock, mask = raw
            dev.clock_sum += sm_clock
            dev.clock_n += 1
            # _TICK_METRICS itself, the same tuple every tick: the layout compare is then a pointer compare.
            rows.add(dev, _TICK_METRICS, [gpu_util, mem_util, mem_used, sm_clock, mem_clock, *decode_throttle(mask)])
            slower = getters[len(_TICK_GETTERS):]  # the slow, static and PCIe getters due this tick
        if slower:
            got = self._sample_each_getter(dev, slower)
            if got is None:
                return False
            rows.add(dev, *got)
        return True

    def _sample_each_getter(self, dev: _Device, getters) -> tuple[tuple, list] | None:
        calls, unsupported = dev.calls, dev.unsupported
        metrics: list[str] = []
        values: list[float] = []
        for name, _, names, reader in getters:
            if name in unsupported:
                continue
            try:
                got = reader(calls)
            except pynvml.NVMLError as exc:
                self._on_error(dev, name, exc)
                if dev.lost:
                    return None
                continue
            except Exception:  # a decoding bug or a pynvml/driver mismatch must not stop the others
                self._count_bug(dev, name)
                continue
            metrics += names
            values += got
            if name == "sm_clock":
                dev.clock_sum += got[0]
                dev.clock_n += 1
            elif name == "sm_clock_max":
                dev.sm_clock_max = got[0]
        return tuple(metrics), values

    def _sample_fields(self, dev: _Device, group: str, batch: FieldBatch, now_ns: int, rows: _Rows) -> None:
        try:
            metrics, out, intervals, rets = batch.sample(dev.calls, now_ns)
        except pynvml.NVMLError as exc:
            self._on_error(dev, f"fields.{group}", exc)
            return
        rows.add(dev, tuple(metrics), out, intervals)  # no copy for the fast path's tuple
        if group == TICK and "nvml.energy_j" in metrics:
            k = metrics.index("nvml.energy_j")
            dev.energy_j += out[k]
            dev.energy_ns += intervals[k]
        if rets:
            dropped = set()
            for i in [i for i, code in enumerate(rets) if code]:
                code, name = rets[i], batch.specs[i].name
                if code in _FIELD_UNSUPPORTED:
                    dropped.add(name)
                    code = pynvml.NVML_ERROR_NOT_SUPPORTED
                self._on_error(dev, name, pynvml.NVMLError(code))
            if dropped:
                batch.drop(dropped)

    def _sample_gpm(self, dev: _Device, rows: _Rows) -> None:
        if dev.gpm is None:
            supported = self._call(dev, "gpm", gpm_supported, dev.handle)
            if supported is None:  # an NVMLError, already handled
                return
            if not supported:  # pre-Hopper: NVML answers, with "no"
                self._mark_unsupported(dev, "gpm")
                return
            dev.gpm = GpmReader(dev.handle)
        result = self._call(dev, "gpm", dev.gpm.read)
        if result is None:
            return
        names, values, failed = result
        if not names and not failed:  # the first sample of a pair: the clock mean starts here
            dev.clock_sum, dev.clock_n = 0.0, 0
        for name, code in failed:
            if code in _UNSUPPORTED:
                dev.gpm.drop(name)
            self._on_error(dev, name.removeprefix("nvml."), pynvml.NVMLError(code))
        if not names:
            return
        rows.add(dev, tuple(names), values)
        # OFU pairs the interval's tensor activity with the interval's mean SM clock.
        clock = dev.clock_sum / dev.clock_n if dev.clock_n else None
        dev.clock_sum, dev.clock_n = 0.0, 0
        if TENSOR_METRIC in names and clock is not None and dev.sm_clock_max is not None:
            ofu = ofu_percent(values[names.index(TENSOR_METRIC)], clock, dev.sm_clock_max)
            if ofu is not None:
                rows.add(dev, ("nvml.ofu",), [ofu])

    def _sample_processes(self, dev: _Device, rows: _Rows, identities: dict) -> None:
        """Process memory and utilization, then this interval's energy split over them (slow cadence)."""
        calls = dev.calls
        procs = self._call(dev, "processes", calls.processes) if "processes" not in dev.unsupported else None
        present: set[int] = set()
        for pid, mem in procs or ():
            present.add(pid)
            if mem is not None:  # None: the driver cannot attribute memory (WDDM)
                self._proc_row(rows, "nvml.proc_mem_used", dev, pid, float(mem), 0, identities)
        util: dict[int, float] = {}
        samples = None
        if "process_util" not in dev.unsupported:
            samples = self._call(dev, "process_util", calls.process_utilization, dev.last_putil_us)
        if dev.lost:
            return
        if samples:
            # NVML holds several samples per pid between slow reads: average them over the interval.
            sums: dict[int, list[float]] = {}
            for pid, _, sm_util, mem_util in samples:
                acc = sums.setdefault(pid, [0.0, 0.0, 0])
                acc[0] += sm_util
                acc[1] += mem_util
                acc[2] += 1
            dev.last_putil_us = max(stamp for _, stamp, _, _ in samples)
            for pid, (sm, mem, n) in sums.items():
                util[pid] = sm / n
                self._proc_row(rows, "nvml.proc_sm_util", dev, pid, sm / n, 0, identities)
                self._proc_row(rows, "nvml.proc_mem_util", dev, pid, mem / n, 0, identities)
        self._attribute_energy(dev, rows, util, present, identities)

    def _attribute_energy(self, dev: _Device, rows: _Rows, util: dict, present: set, identities: dict) -> None:
        """nvml.proc_energy_j: the device energy since the last split, over its processes (see energy.py).

        The split runs at the process cadence, so each row covers the energy
        deltas summed since the previous split and carries their total interval.
        """
        joules, interval_ns = dev.energy_j, dev.energy_ns
        dev.energy_j, dev.energy_ns = 0.0, 0
        if interval_ns <= 0:
            return
        for pid, share in split_energy(joules, util, present).items():
            self._proc_row(rows, "nvml.proc_energy_j", dev, pid, share, interval_ns, identities)

    # -- bookkeeping -------------------------------------------------------

    def _call(self, dev: _Device, name: str, fn, *args):
        """fn(*args), or None after handling its NVMLError."""
        try:
            return fn(*args)
        except pynvml.NVMLError as exc:
            self._on_error(dev, name, exc)
        except Exception:  # a decoding bug or a pynvml/driver mismatch must not stop the other fields or GPUs
            self._count_bug(dev, name)
        return None

    def _count_bug(self, dev: _Device, name: str) -> None:
        count = self.errors[name] = self.errors.get(name, 0) + 1
        if count == 1:
            log.exception("NVML field %r on GPU %d failed; skipped while it keeps failing", name, dev.index)

    def _on_error(self, dev: _Device, name: str, exc: pynvml.NVMLError) -> None:
        code = exc.value
        if code == pynvml.NVML_ERROR_GPU_IS_LOST:
            if not dev.lost:
                dev.lost = True
                log.error("GPU %d fell off the bus (NVML: GPU is lost); no longer sampling it, "
                          "the other GPUs continue; check dmesg for Xid 79 and reset or drain the node", dev.index)
                self._status("nvml.gpu_lost", dev.label, 1.0, gpu=dev.index)
        elif code in _UNSUPPORTED:
            self._mark_unsupported(dev, name)
        else:
            count = self.errors[name] = self.errors.get(name, 0) + 1
            if count == 1:
                log.warning("NVML %r failed on GPU %d (%s); skipped this tick, counted in errors", name, dev.index, exc)

    def _mark_unsupported(self, dev: _Device, name: str) -> None:
        if name in dev.unsupported:
            return
        dev.unsupported.add(name)
        log.warning("GPU %d does not support %r (NVML: not supported by this GPU or driver); skipping it",
                    dev.index, name)
        self._status("nvml.unsupported", f"{dev.label}:{name}", 1.0, gpu=dev.index)

    def _status(self, metric: str, device: str, value: float, gpu: int = NO_GPU) -> None:
        self._pending.append((metric, device, value, gpu))

    def _proc_row(self, rows: _Rows, metric: str, dev: _Device, pid: int, value: float, interval_ns: int,
                  identities: dict) -> None:
        ident = identities.get(pid)
        if ident is None:
            ident = identities[pid] = self._resolve(pid)
        rows.procs.append((metric, dev.label, value, interval_ns, dev.index, pid) + ident)

    def _resolve(self, pid: int) -> tuple:
        """(tenant, job, rank, pod, namespace, container) of a GPU process: the resolver's (which caches it
        per pid), else unattributed and unplaced. Called once per pid per tick."""
        if self.resolver is None:
            return _UNRESOLVED
        try:
            ident = self.resolver.resolve(pid)
        except Exception:  # a process can exit mid-resolution; its rows still count, unattributed
            self.errors["resolver"] = self.errors.get("resolver", 0) + 1
            log.debug("identity of pid %d not resolved", pid, exc_info=True)
            return _UNRESOLVED
        if ident is None:
            return _UNRESOLVED
        rank = getattr(ident, "rank", None)
        placement = getattr(ident, "placement", None)  # resolvers other than IdentityResolver may not know it
        return (ident.tenant or None, ident.job or None, NO_RANK if rank is None else int(rank),
                *(placement() if placement is not None else _NO_PLACEMENT))


_NO_PLACEMENT = ("", "", "")
_UNRESOLVED = (None, None, NO_RANK, *_NO_PLACEMENT)


_I8, _F8 = np.dtype("<i8"), np.dtype("<f8")
# _Columns.batch writes the columns out in this order; fail at import, not in a consumer, if the schema changes.
assert tuple(SOURCE_COLUMNS["nvml"]) == ("ts_ns", "tenant", "job", "rank", "pid", "gpu", "metric", "device",
                                         "value", "interval_ns"), "update _Columns.batch"


def _layout_columns(layout: tuple) -> tuple:
    """The metric, device and gpu columns that a tick's row layout spells out."""
    metric = [m for metrics, _, _ in layout for m in metrics]
    device = [d for metrics, d, _ in layout for _ in metrics]
    gpu = np.array([g for metrics, _, g in layout for _ in metrics], dtype="<i2")
    return str_column(metric), str_column(device), gpu


class _Columns:
    """Builds a tick's batch from its rows. The metric, device and gpu columns
    and the node identity are reused while the tick's layout repeats (see
    producers/host/columns.py): most ticks carry the same rows as the last."""

    def __init__(self, host: str):
        self.host = host
        self._identity = NodeIdentityColumns(host)
        self._layout = RepeatingColumn(_layout_columns)
        self._proc_identity = RepeatingColumn(self._identity_columns)
        self._batch_id = BatchIds()

    def _identity_columns(self, key: tuple) -> tuple:
        """tenant, job, rank and pid for n_node node rows, then one row per (pid, tenant, job, rank, pod,
        namespace, container); then pod, namespace and container ('' on node rows) when a process has any."""
        n_node, idents = key
        host = self.host
        columns = (str_column([NODE_TENANT] * n_node + [i[1] or NODE_TENANT for i in idents]),
                   str_column([host] * n_node + [i[2] or host for i in idents]),
                   np.array([NO_RANK] * n_node + [i[3] for i in idents], dtype="<i4"),
                   np.array([0] * n_node + [i[0] for i in idents], dtype="<i4"))
        if all(i[4:] == _NO_PLACEMENT for i in idents):
            return columns
        return columns + tuple(str_column([""] * n_node + [i[k] for i in idents]) for k in (4, 5, 6))

    def batch(self, pending: list[tuple], rows: _Rows, now_ns: int) -> Batch:
        """Status rows, device rows, then process rows."""
        host = self.host
        layout, value, interval = rows.layout, rows.value, rows.interval
        if pending:
            layout = [((p[0],), p[1], p[3]) for p in pending] + layout
            value = [p[2] for p in pending] + value
            interval = [0] * len(pending) + interval
        n_node, procs = len(value), rows.procs
        n = n_node + len(procs)
        if not procs:
            columns = self._identity(n)
        else:
            layout = layout + [((p[0],), p[1], p[4]) for p in procs]
            value = value + [p[2] for p in procs]
            interval = interval + [p[3] for p in procs]
            # Kept per layout too: the same processes usually hold the GPUs from one read to the next.
            identity = self._proc_identity((n_node, tuple(p[5:] for p in procs)))
            columns = dict(zip(("tenant", "job", "rank", "pid", *PLACEMENT_COLUMNS), identity))
        metric, device, gpu = self._layout(layout)
        ts = np.empty(n, dtype=_I8)
        ts.fill(now_ns)
        placement = {name: columns[name] for name in PLACEMENT_COLUMNS if name in columns}  # process rows only
        return Batch(source="nvml", host=host, created_ns=now_ns, batch_id=self._batch_id(), columns={
            "ts_ns": ts, "tenant": columns["tenant"], "job": columns["job"], "rank": columns["rank"],
            "pid": columns["pid"], "gpu": gpu, "metric": metric, "device": device,
            "value": np.array(value, dtype=_F8), "interval_ns": np.array(interval, dtype=_I8), **placement})


def build_source(cfg, new_resolver, publish) -> NvmlSampler:
    """The agent's nvml source. Without a usable NVML it still runs: it reports one nvml.status row."""
    return NvmlSampler(cfg.host, resolver=new_resolver(), library_path=cfg.nvml_library)
