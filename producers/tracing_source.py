"""The agent's `trace` source: the eBPF tracers, run by one TracerManager, joining when they are ready.

Compiling the BPF programs and calibrating the probe cost take seconds, so the manager is built on a
thread: host and GPU sampling start at once, and until the manager is ready this source samples nothing.
Tracing is an add-on: a host that cannot trace (no root, no tracer that starts) logs why, once, and the
agent samples without it.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)


def start_manager(cfg, resolver):
    """A started TracerManager for cfg.trace, or None (with the reason logged) when no tracer can run."""
    from fleetscope.config import ConfigError
    from fleetscope.producers.tracers.manager import TracerManager
    try:
        manager = TracerManager(cfg, resolver=resolver)
    except ConfigError as e:  # a setting only the loaded tracers can check (trace_off's family names)
        log.error("eBPF tracing is off: configuration error: %s", e)
        return None
    except Exception:  # tracing is an add-on: the agent keeps sampling without it
        log.exception("eBPF tracing is off: the tracer manager failed to start")
        return None
    if not manager.tracers:
        log.warning("eBPF tracing is off: no tracer could start (%s)", "; ".join(manager.unavailable.values()))
        return None
    return manager


class TracingSource:
    name = "trace"

    def __init__(self, make_manager: Callable[[], object | None]):
        """make_manager builds the (not yet started) manager; it runs on this source's start thread."""
        self._make_manager = make_manager
        self._lock = threading.Lock()  # the manager arriving vs. the agent stopping
        self._closed = False
        self.manager = None
        self.on_records = None  # the anomaly capture's add_records, when configured (producers/trace_capture.py)
        self.on_drained = None  # the anomaly capture's drained, likewise
        self._detail_until = 0  # the latest monotonic deadline asked of the tracers' detail gate (0: none)
        self._detail_lock = threading.Lock()  # not _lock: that one is held while the manager starts (seconds)
        self._thread = threading.Thread(target=self._start, name="tracer-start", daemon=True)

    def start(self) -> "TracingSource":
        self._thread.start()
        return self

    def _start(self) -> None:
        try:  # Linux nices threads one by one: the BPF compile must not slow the pipeline's start
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except OSError:
            pass
        manager = self._make_manager()
        if manager is None:
            return
        with self._lock:
            if self._closed:  # the agent stopped while the programs compiled
                manager.close()
                return
            manager.start()
            self.manager = manager
        with self._detail_lock:
            if self._detail_until:  # a live request came while the programs compiled
                manager.set_detail_until(self._detail_until)

    @property
    def settled(self) -> bool:
        """The manager runs, or never will (no tracer could start, or the agent stopped while it compiled)."""
        return self.manager is not None or (self._thread.ident is not None and not self._thread.is_alive())

    def traced_since(self, pids) -> float | None:
        """When every tracer had tried each of ``pids`` (TracerManager.traced_since); 0.0 when no manager will
        run, None while it compiles or has not tried them all."""
        manager = self.manager
        if manager is None:
            return 0.0 if self.settled else None
        return manager.traced_since(pids)

    def sample(self, now_ns: int) -> list:
        manager = self.manager
        if manager is None:
            return []
        manager.on_records = self.on_records
        manager.on_drained = self.on_drained
        return manager.sample(now_ns)

    def open_detail(self, until_wall_ns: int) -> None:
        """Have the tracers send per-call records until wall time `until_wall_ns` (a live capture request's end),
        or later if an earlier call asked for later. Called on the capture's listener thread; never blocks on
        a tracer's lock (one BPF map update each), never raises."""
        until = int(until_wall_ns) - time.time_ns() + time.monotonic_ns()
        with self._detail_lock:  # held while setting: a later, shorter request must not lower the gate
            self._detail_until = max(self._detail_until, until)
            manager = self.manager
            if manager is not None:
                manager.set_detail_until(self._detail_until)

    def stats(self) -> dict:
        manager = self.manager
        return manager.stats() if manager is not None else {}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            manager = self.manager
        if manager is not None:
            manager.close()


def build_source(cfg, new_resolver, publish) -> TracingSource | None:
    if os.geteuid() != 0:
        log.warning("eBPF tracing is off: the agent is not root (it needs CAP_BPF and CAP_PERFMON); "
                    "host and GPU sampling continue")
        return None
    resolver = new_resolver()  # here, not on the thread: a broken tenant map stops the agent's start
    return TracingSource(lambda: start_manager(cfg, resolver)).start()
