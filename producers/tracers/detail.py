"""Detail mode, as the tracers that have it share it (gpu_calls.py: CUDA and NCCL; torch_ops.py: torch;
python_vm.py: Python, one BPF program per interpreter object).

Built with -DDETAIL, a tracer's BPF program has a ring buffer `calls` of per-call records and a gate
`detail_until` (BPF_ARRAY(u64, 1)): records are sent only while bpf_ktime_get_ns() (CLOCK_MONOTONIC) is before
its value. `set_detail_until` sets it (time.monotonic_ns() deadlines; DETAIL_FOREVER opens it for the whole
run, 0 closes it); with detail_always the gate opens for good at construction. Each sample drains the ring
into `records` ({api, pid, tid, ts_ns (epoch), dur_ns, ...}) through the tracer's `_on_record`.
"""
from __future__ import annotations

import contextlib
import logging
import threading

from fleetscope.producers.tracers.clock import MonotonicClock

log = logging.getLogger(__name__)

DETAIL_FOREVER = 2**64 - 1  # the gate's deadline when it is open for the whole run


def detail_flags(detail: bool, ring_pages: int) -> list[str]:
    """The BPF compile flags of detail mode (RING_PAGES: the ring's size in pages, a power of two)."""
    return [f"-DRING_PAGES={ring_pages}"] + (["-DDETAIL"] if detail else [])


class DetailRecords:
    """Mixin: `records`, `detail_until`, `set_detail_until` over a tracer's BPF programs, each with its own ring and
    gate: its one `bpf` (None once closed), taken by `_init_detail`, or for a tracer with several (the Python
    tracer: one per interpreter object) each given to `_detail_program` as it is loaded, which sets its gate to
    the current deadline. Records reach the tracer's `_on_record(ctx, data, size)` (or the callback given with
    the program). The tracer calls `_init_detail` once (after loading `bpf`, if it has one), `_drain_records` in
    each sample, and sets `_gate = None` (or calls `_close_detail`) when it closes."""
    _gate = None  # [(program, its detail_until table)]; None: built without detail mode, or closed
    _gate_lock = contextlib.nullcontext()  # a real lock from _init_detail on

    def _init_detail(self, detail: bool, detail_always: bool, name: str) -> None:
        self.detail = detail
        self.clock = MonotonicClock()
        self.records: list[dict] = []  # detail mode: the calls drained by the latest sample()
        self.detail_until = 0  # the gate's deadline (monotonic ns) as last set; 0: closed
        self._gate = [] if detail else None
        self._gate_lock = threading.Lock()  # a program added while the deadline changes gets the new one
        self._detail_name = name
        self._said_no_detail = False
        if detail:
            if getattr(self, "bpf", None) is not None:
                self._detail_program(self.bpf)
            if detail_always:
                self.set_detail_until(DETAIL_FOREVER)

    def _detail_program(self, bpf, on_record=None) -> None:
        """Take a loaded program's ring (records to `on_record`, default `_on_record`) and gate, the gate set to
        the current deadline. Nothing without detail mode or once closed."""
        if not self.detail:
            return
        bpf[b"calls"].open_ring_buffer(on_record or self._on_record)
        gate = bpf[b"detail_until"]  # taken here: setting it later touches no bcc table cache
        with self._gate_lock:
            if self._gate is None:
                return
            self._gate.append((bpf, gate))
            if self.detail_until:
                gate[gate.Key(0)] = gate.Leaf(self.detail_until)

    def set_detail_until(self, monotonic_ns: int) -> bool:
        """Send per-call records until CLOCK_MONOTONIC `monotonic_ns` (0 closes the gate), in every program of the
        tracer and in those it loads later. False, with nothing set, when this tracer was built without detail
        mode or is closed. One BPF map update per program: safe beside the tracer's other calls without its
        lock."""
        with self._gate_lock:
            gates = self._gate
            if gates is None:
                if not self.detail and not self._said_no_detail:
                    self._said_no_detail = True
                    log.warning("%s tracer: built without detail mode (trace_capture_s = 0), so it has no "
                                "per-call records to switch on", self._detail_name)
                return False
            value = min(max(int(monotonic_ns), 0), DETAIL_FOREVER)
            for _, gate in gates:
                gate[gate.Key(0)] = gate.Leaf(value)
            self.detail_until = value
            return True

    def _drain_records(self) -> None:
        """This sample's records: the rings' pending ones, all of them, once."""
        if self.detail:
            self.records = []
            for bpf, _ in list(self._gate or ()):
                bpf.ring_buffer_consume()

    def _close_detail(self) -> None:
        """Close every program's gate and stop taking programs (the tracer is closing)."""
        if self._gate is not None:
            self.set_detail_until(0)
            self._gate = None

    def _on_record(self, ctx, data, size) -> None:
        raise NotImplementedError


__all__ = ["DETAIL_FOREVER", "DetailRecords", "detail_flags"]
