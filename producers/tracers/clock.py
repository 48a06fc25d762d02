"""BPF timestamps (CLOCK_MONOTONIC, from bpf_ktime_get_ns) to event time (ns since the Unix epoch).

The offset is measured once per tracer as the midpoint of a realtime read
bracketed by two monotonic reads, the tightest pairing user space can get.
A wall-clock step (NTP) after start shifts later events by the step; callers
that run for days may call `refresh()` on a timer.
"""
from __future__ import annotations

import time

import numpy as np


class MonotonicClock:
    def __init__(self):
        self.offset_ns = 0
        self.refresh()

    def refresh(self) -> int:
        best = None
        for _ in range(5):  # keep the tightest bracket of five
            a = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            wall = time.time_ns()
            b = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            if best is None or b - a < best[0]:
                best = (b - a, wall - (a + b) // 2)
        self.offset_ns = best[1]
        return self.offset_ns

    def to_epoch_ns(self, mono_ns):
        """One value or a numpy array of monotonic ns, as epoch ns."""
        if isinstance(mono_ns, np.ndarray):
            return mono_ns.astype("<i8") + self.offset_ns
        return int(mono_ns) + self.offset_ns
