"""NvmlSampler: read every GPU through NVML once per tick into one "nvml" batch.

Device rows carry the node identity and the GPU index; per-process rows carry
the identity that `resolver.resolve(pid)` gives (an object with tenant, job
and rank), or the node identity with the pid when it gives none. Metrics and
units are listed in producers/nvml/__init__.py.

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
from typing import NamedTuple

import numpy as np
import pynvml

from fleetscope.schema import NO_GPU, NO_RANK, NODE_TENANT, SOURCE_COLUMNS
from fleetscope.wire import Batch, StrColumn
from producers.nvml.device_metrics import DEVICE_FIELDS, NVLINK_FIELDS, SLOW_FIELDS, Reading, read_nvlink
from producers.nvml.energy import split_energy
from producers.nvml.gpm import TENSOR_METRIC, GpmReader, gpm_supported, ofu_percent
from producers.nvml.library import NvmlUnavailable, close_nvml, open_nvml

log = logging.getLogger(__name__)

_UNSUPPORTED = {pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND}


class _Row(NamedTuple):
    metric: str
    device: str
    value: float
    interval_ns: int
    gpu: int
    pid: int = 0
    tenant: str | None = None  # None: the node identity
    job: str | None = None
    rank: int = NO_RANK


@dataclass
class _Device:
    index: int
    handle: object
    lost: bool = False
    unsupported: set[str] = field(default_factory=set)
    counters: dict[str, tuple[float, int]] = field(default_factory=dict)  # metric -> (value, ts_ns)
    nvlink: list = field(default_factory=lambda: list(NVLINK_FIELDS))
    gpm: GpmReader | None = None
    last_slow_ns: int | None = None
    last_putil_us: int = 0  # NVML's lastSeenTimeStamp for process-utilization samples

    @property
    def label(self) -> str:
        return f"gpu{self.index}"


class NvmlSampler:
    def __init__(self, host: str, resolver=None, library_path: str | None = None,
                 pcie_min_interval_ns: int = 1_000_000_000):
        self.host = host
        self.resolver = resolver
        self.pcie_min_interval_ns = int(pcie_min_interval_ns)
        self.errors: dict[str, int] = {}
        self._pending: list[_Row] = []  # status rows for the next batch
        self._devices: list[_Device] = []
        self._active = False
        self._opened = False
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
        for index in range(count):
            self._open_device(index)
        self._active = True

    def _open_device(self, index: int) -> None:
        try:
            dev = _Device(index, pynvml.nvmlDeviceGetHandleByIndex(index))
        except pynvml.NVMLError as exc:
            dev = _Device(index, None)
            self._on_error(dev, "handle", exc)
            if not dev.lost:
                log.error("GPU %d has no NVML handle (%s); it will not be sampled", index, exc)
            return
        self._devices.append(dev)

    def sample(self, now_ns: int | None = None) -> Batch | None:
        """One batch of every GPU's readings at now_ns, or None if there are none."""
        now_ns = time.time_ns() if now_ns is None else int(now_ns)
        rows: list[_Row] = []
        if self._active:
            identities: dict[int, tuple] = {}
            for dev in self._devices:
                if not dev.lost:
                    self._sample_device(dev, now_ns, rows, identities)
        # Status found during this tick (and at start-up) leads this tick's batch.
        rows, self._pending = self._pending + rows, []
        return _batch(self.host, rows, now_ns) if rows else None

    def close(self) -> None:
        for dev in self._devices:
            if dev.gpm is not None:
                dev.gpm.close()
        self._devices, self._active = [], False
        if self._opened:
            close_nvml()
            self._opened = False

    # -- one device --------------------------------------------------------

    def _sample_device(self, dev: _Device, now_ns: int, rows: list[_Row], identities: dict) -> None:
        values: dict[str, float] = {}  # this tick's gauges, for OFU
        slow_due = dev.last_slow_ns is None or now_ns - dev.last_slow_ns >= self.pcie_min_interval_ns
        for name, reader in DEVICE_FIELDS:
            if name in dev.unsupported or (name in SLOW_FIELDS and not slow_due):
                continue
            readings = self._call(dev, name, reader, dev.handle)
            if dev.lost:
                return
            for r in readings or ():
                self._emit(dev, r, now_ns, rows, values)
        if slow_due:
            dev.last_slow_ns = now_ns
        if dev.nvlink and "nvlink" not in dev.unsupported:
            self._sample_nvlink(dev, now_ns, rows, values)
        if not dev.lost and "gpm" not in dev.unsupported:
            self._sample_gpm(dev, rows, values)
        if not dev.lost:
            start = len(rows)
            self._sample_processes(dev, rows, identities)
            self._attribute_energy(dev, rows, start, identities)

    def _sample_nvlink(self, dev, now_ns, rows, values) -> None:
        result = self._call(dev, "nvlink", read_nvlink, dev.handle, dev.nvlink)
        if result is None:
            return
        readings, failed = result
        self._report_failed(dev, failed, dev.nvlink.remove, lambda f: f"nvlink.{f.name}")
        for r in readings:
            self._emit(dev, r, now_ns, rows, values)

    def _sample_gpm(self, dev, rows, values) -> None:
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
        gpm_values, failed = result
        self._report_failed(dev, failed, dev.gpm.drop, lambda name: name.removeprefix("nvml."))
        for name, value in gpm_values.items():
            rows.append(_Row(name, dev.label, value, 0, dev.index))
        if TENSOR_METRIC in gpm_values and "nvml.sm_clock_mhz" in values and "nvml.sm_clock_max_mhz" in values:
            ofu = ofu_percent(gpm_values[TENSOR_METRIC], values["nvml.sm_clock_mhz"], values["nvml.sm_clock_max_mhz"])
            if ofu is not None:
                rows.append(_Row("nvml.ofu", dev.label, ofu, 0, dev.index))

    def _sample_processes(self, dev, rows, identities) -> None:
        procs = self._call(dev, "processes", pynvml.nvmlDeviceGetComputeRunningProcesses, dev.handle) \
            if "processes" not in dev.unsupported else None
        for p in procs or ():
            if p.usedGpuMemory is not None:  # None: the driver cannot attribute memory (WDDM)
                rows.append(self._proc_row("nvml.proc_mem_used", dev, p.pid, float(p.usedGpuMemory), identities))
        if "process_util" in dev.unsupported:
            return
        samples = self._call(dev, "process_util", _process_samples, dev.handle, dev.last_putil_us)
        if dev.lost or not samples:
            return
        latest: dict[int, object] = {}  # NVML may hold several samples per pid; keep the newest
        for s in samples:
            if s.pid not in latest or s.timeStamp > latest[s.pid].timeStamp:
                latest[s.pid] = s
        dev.last_putil_us = max(s.timeStamp for s in samples)
        for pid, s in latest.items():
            rows.append(self._proc_row("nvml.proc_sm_util", dev, pid, float(s.smUtil), identities))
            rows.append(self._proc_row("nvml.proc_mem_util", dev, pid, float(s.memUtil), identities))

    def _attribute_energy(self, dev: _Device, rows: list[_Row], proc_start: int, identities: dict) -> None:
        """nvml.proc_energy_j: this tick's device energy split over its processes (see energy.py)."""
        energy = next((r for r in rows if r.metric == "nvml.energy_j" and r.gpu == dev.index), None)
        if energy is None:
            return
        procs = rows[proc_start:]
        util = {r.pid: r.value for r in procs if r.metric == "nvml.proc_sm_util"}
        present = {r.pid for r in procs}
        for pid, joules in split_energy(energy.value, util, present).items():
            row = self._proc_row("nvml.proc_energy_j", dev, pid, joules, identities)
            rows.append(row._replace(interval_ns=energy.interval_ns))

    # -- bookkeeping -------------------------------------------------------

    def _report_failed(self, dev: _Device, failed, drop, field_name) -> None:
        """Per-field failures of a multi-field read: stop asking for what is unsupported, report each."""
        for key, code in failed:
            if code in _UNSUPPORTED:
                drop(key)
            self._on_error(dev, field_name(key), pynvml.NVMLError(code))

    def _call(self, dev: _Device, name: str, fn, *args):
        """fn(*args), or None after handling its NVMLError."""
        try:
            return fn(*args)
        except pynvml.NVMLError as exc:
            self._on_error(dev, name, exc)
        except Exception:  # a decoding bug or a pynvml/driver mismatch must not stop the other fields or GPUs
            count = self.errors[name] = self.errors.get(name, 0) + 1
            if count == 1:
                log.exception("NVML field %r on GPU %d failed; skipped while it keeps failing", name, dev.index)
        return None

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
        log.warning("GPU %d does not support %r (NVML: not supported by this GPU or driver); skipping it", dev.index, name)
        self._status("nvml.unsupported", f"{dev.label}:{name}", 1.0, gpu=dev.index)

    def _status(self, metric: str, device: str, value: float, gpu: int = NO_GPU) -> None:
        self._pending.append(_Row(metric, device, value, 0, gpu))

    def _emit(self, dev: _Device, r: Reading, now_ns: int, rows: list[_Row], values: dict) -> None:
        if r.counter_scale is None:
            values[r.metric] = float(r.value)
            rows.append(_Row(r.metric, dev.label, float(r.value), 0, dev.index))
            return
        prev = dev.counters.get(r.metric)
        dev.counters[r.metric] = (float(r.value), now_ns)
        # First sample, a counter that went backwards (driver reload, reset), or no time passed: no delta.
        if prev is not None and r.value >= prev[0] and now_ns > prev[1]:
            rows.append(_Row(r.metric, dev.label, (r.value - prev[0]) * r.counter_scale, now_ns - prev[1], dev.index))

    def _proc_row(self, metric: str, dev: _Device, pid: int, value: float, identities: dict) -> _Row:
        ident = identities.get(pid)
        if ident is None:
            ident = identities[pid] = self._resolve(pid)
        tenant, job, rank = ident
        return _Row(metric, dev.label, value, 0, dev.index, pid, tenant, job, rank)

    def _resolve(self, pid: int) -> tuple:
        if self.resolver is None:
            return None, None, NO_RANK
        try:
            ident = self.resolver.resolve(pid)
        except Exception:  # a process can exit mid-resolution; its rows still count, unattributed
            self.errors["resolver"] = self.errors.get("resolver", 0) + 1
            log.debug("identity of pid %d not resolved", pid, exc_info=True)
            return None, None, NO_RANK
        if ident is None:
            return None, None, NO_RANK
        rank = getattr(ident, "rank", None)
        return ident.tenant or None, ident.job or None, NO_RANK if rank is None else int(rank)


def _process_samples(handle, last_seen_us: int) -> list:
    try:
        return pynvml.nvmlDeviceGetProcessUtilization(handle, last_seen_us)
    except pynvml.NVMLError_NotFound:
        return []  # NVML's way of saying it holds no samples newer than last_seen_us


def _batch(host: str, rows: list[_Row], now_ns: int) -> Batch:
    n = len(rows)
    columns = {"ts_ns": np.full(n, now_ns, dtype="<i8"),
               "tenant": _str_column([r.tenant or NODE_TENANT for r in rows]),
               "job": _str_column([r.job or host for r in rows]),
               "rank": np.fromiter((r.rank for r in rows), dtype="<i4", count=n),
               "pid": np.fromiter((r.pid for r in rows), dtype="<i4", count=n),
               "gpu": np.fromiter((r.gpu for r in rows), dtype="<i2", count=n),
               "metric": _str_column([r.metric for r in rows]),
               "device": _str_column([r.device for r in rows]),
               "value": np.fromiter((r.value for r in rows), dtype="<f8", count=n),
               "interval_ns": np.fromiter((r.interval_ns for r in rows), dtype="<i8", count=n)}
    # Schema order, and a KeyError here (not in a consumer) if the schema grows a column.
    return Batch(source="nvml", host=host, created_ns=now_ns,
                 columns={name: columns[name] for name in SOURCE_COLUMNS["nvml"]})


def _str_column(items: list[str]) -> StrColumn:
    index: dict[str, int] = {}
    codes = np.fromiter((index.setdefault(s, len(index)) for s in items), dtype=np.uint32, count=len(items))
    return StrColumn(codes, tuple(index))
