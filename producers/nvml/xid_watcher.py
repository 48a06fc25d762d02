"""XidWatcher: NVML critical events, published the moment they arrive.

An Xid (say 79, "GPU has fallen off the bus", or 48, a double-bit ECC error)
explains an anomaly only if it reaches the pipeline before the window closes,
so events do not wait for the sampler's next tick: a daemon thread blocks in
nvmlEventSetWait_v2 (with a short timeout, so stop() is prompt) and publishes
one small batch per event.

Rows: "nvml.xid" (value = Xid code), "nvml.event.dbe_ecc" (value 1) and
"nvml.event.clock_change" (value 1), device "gpu<N>", node identity.
If NVML or event sets are unavailable it publishes one "nvml.status" row
(device "library", "init" or "events", value 0) and the thread exits.
"""
from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable

import numpy as np
import pynvml

from fleetscope.schema import SOURCE_COLUMNS, node_identity
from fleetscope.wire import Batch, StrColumn
from fleetscope.producers.nvml.library import NvmlUnavailable, close_nvml, open_nvml

log = logging.getLogger(__name__)

_EVENTS = ((pynvml.nvmlEventTypeXidCriticalError, "nvml.xid"),
           (pynvml.nvmlEventTypeDoubleBitEccError, "nvml.event.dbe_ecc"),
           (pynvml.nvmlEventTypeClock, "nvml.event.clock_change"))
_WANTED = 0
for _bit, _ in _EVENTS:
    _WANTED |= _bit


class XidWatcher:
    def __init__(self, host: str, publish: Callable[[Batch], None], library_path: str | None = None,
                 wait_ms: int = 200):
        self.host = host
        self.publish = publish
        self.library_path = library_path
        self.wait_ms = int(wait_ms)
        self.events = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> XidWatcher:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="nvml-xid-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            open_nvml(self.library_path)
        except NvmlUnavailable as exc:
            log.warning("NVML unavailable, no Xid events on %s: %s", self.host, exc)
            self._send("nvml.status", exc.what, 0.0)
            return
        event_set = None
        try:
            event_set = pynvml.nvmlEventSetCreate()
            gpus = self._register(event_set)
            if not gpus:
                log.warning("no GPU on %s supports NVML event sets; Xid events will not be watched", self.host)
                self._send("nvml.status", "events", 0.0)
                return
            self._wait_loop(event_set, gpus)
        except pynvml.NVMLError as exc:
            log.error("NVML event sets failed on %s (%s); Xid events will not be watched", self.host, exc)
            self._send("nvml.status", "events", 0.0)
        finally:
            if event_set is not None:
                try:
                    pynvml.nvmlEventSetFree(event_set)
                except pynvml.NVMLError:
                    pass  # freeing a set after a lost GPU can fail; the process exits soon anyway
            close_nvml()

    def _register(self, event_set) -> dict[int, int]:
        """Register every GPU that supports any wanted event; {handle address: index}."""
        gpus = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                types = pynvml.nvmlDeviceGetSupportedEventTypes(handle) & _WANTED
                if types:
                    pynvml.nvmlDeviceRegisterEvents(handle, types, event_set)
                    gpus[_address(handle)] = index
            except pynvml.NVMLError as exc:
                log.warning("GPU %d: no NVML events (%s)", index, exc)
        return gpus

    def _wait_loop(self, event_set, gpus: dict[int, int]) -> None:
        while not self._stop.is_set():
            try:
                data = pynvml.nvmlEventSetWait_v2(event_set, self.wait_ms)
            except pynvml.NVMLError_Timeout:
                continue
            except pynvml.NVMLError as exc:
                self.errors += 1
                if self.errors == 1:
                    log.warning("NVML event wait failed (%s); retrying", exc)
                self._stop.wait(self.wait_ms / 1000)  # do not spin on a persistent error
                continue
            self.events += 1
            gpu = gpus.get(_address(data.device), -1)
            for bit, metric in _EVENTS:
                if data.eventType & bit:
                    value = float(data.eventData) if metric == "nvml.xid" else 1.0
                    if metric == "nvml.xid":
                        log.error("GPU %d reported Xid %d", gpu, data.eventData)
                    self._send(metric, f"gpu{gpu}", value, gpu)

    def _send(self, metric: str, device: str, value: float, gpu: int = -1) -> None:
        now_ns = time.time_ns()
        ident = node_identity(self.host, 1)
        ident["gpu"] = np.full(1, gpu, dtype="<i2")
        columns = {"ts_ns": np.full(1, now_ns, dtype="<i8"), **ident,
                   "metric": StrColumn.constant(metric, 1), "device": StrColumn.constant(device, 1),
                   "value": np.full(1, value, dtype="<f8"), "interval_ns": np.zeros(1, dtype="<i8")}
        batch = Batch(source="nvml", host=self.host, created_ns=now_ns,
                      columns={name: columns[name] for name in SOURCE_COLUMNS["nvml"]})
        try:
            self.publish(batch)
        except Exception:  # a publisher failure must not kill the watcher
            log.exception("publishing an NVML event batch failed")


def _address(handle) -> int:
    return ctypes.cast(handle, ctypes.c_void_p).value or 0
