"""Detail mode, as the tracers that have it share it (gpu_calls.py: CUDA and NCCL; torch_ops.py: torch).

Built with -DDETAIL, a tracer's BPF program has a ring buffer `calls` of per-call records and a gate
`detail_until` (BPF_ARRAY(u64, 1)): records are sent only while bpf_ktime_get_ns() (CLOCK_MONOTONIC) is before
its value. `set_detail_until` sets it (time.monotonic_ns() deadlines; DETAIL_FOREVER opens it for the whole
run, 0 closes it); with detail_always the gate opens for good at construction. Each sample drains the ring
into `records` ({api, pid, tid, ts_ns (epoch), dur_ns, ...}) through the tracer's `_on_record`.
"""
from __future__ import annotations

import logging

from fleetscope.producers.tracers.clock import MonotonicClock

log = logging.getLogger(__name__)

DETAIL_FOREVER = 2**64 - 1  # the gate's deadline when it is open for the whole run


def detail_flags(detail: bool, ring_pages: int) -> list[str]:
    """The BPF compile flags of detail mode (RING_PAGES: the ring's size in pages, a power of two)."""
    return [f"-DRING_PAGES={ring_pages}"] + (["-DDETAIL"] if detail else [])


class DetailRecords:
    """Mixin: `records`, `detail_until`, `set_detail_until` over a tracer's `bpf` (None once closed) and its
    `_on_record(ctx, data, size)`. The tracer calls `_init_detail` once its BPF program is loaded,
    `_drain_records` in each sample, and sets `_gate = None` when it closes."""
    _gate = None

    def _init_detail(self, detail: bool, detail_always: bool, name: str) -> None:
        self.detail = detail
        self.clock = MonotonicClock()
        self.records: list[dict] = []  # detail mode: the calls drained by the latest sample()
        self.detail_until = 0  # the gate's deadline (monotonic ns) as last set; 0: closed
        self._gate = None
        self._detail_name = name
        self._said_no_detail = False
        if detail:
            self.bpf[b"calls"].open_ring_buffer(self._on_record)
            self._gate = self.bpf[b"detail_until"]  # taken here: setting it later touches no bcc table cache
            if detail_always:
                self.set_detail_until(DETAIL_FOREVER)

    def set_detail_until(self, monotonic_ns: int) -> bool:
        """Send per-call records until CLOCK_MONOTONIC `monotonic_ns` (0 closes the gate). False, with nothing
        set, when this tracer was built without detail mode or is closed. One BPF map update: safe beside the
        tracer's other calls without its lock."""
        gate = self._gate
        if gate is None or getattr(self, "bpf", None) is None:
            if not self.detail and not self._said_no_detail:
                self._said_no_detail = True
                log.warning("%s tracer: built without detail mode (trace_capture_s = 0), so it has no per-call "
                            "records to switch on", self._detail_name)
            return False
        value = min(max(int(monotonic_ns), 0), DETAIL_FOREVER)
        gate[gate.Key(0)] = gate.Leaf(value)
        self.detail_until = value
        return True

    def _drain_records(self) -> None:
        """This sample's records: the ring's pending ones, all of them, once."""
        if self.detail:
            self.records = []
            self.bpf.ring_buffer_consume()

    def _on_record(self, ctx, data, size) -> None:
        raise NotImplementedError


__all__ = ["DETAIL_FOREVER", "DetailRecords", "detail_flags"]
