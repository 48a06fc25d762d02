"""Virtual-memory event counters (NUMA placement, faults, THP, swap) from /proc/vmstat."""
from __future__ import annotations

import re

from fleetscope.producers.host.collector import SLOW_CADENCE_NS, Collector, CounterDeltas, Sample, register

# Only the counters that explain slow training steps: remote-node allocations,
# major faults, THP fallbacks and swapping. Kernels without NUMA or THP lack
# some of them; those are just absent.
_FIELDS = ("numa_hit", "numa_miss", "numa_foreign", "numa_local", "numa_other", "pgfault",
           "pgmajfault", "thp_fault_alloc", "thp_fault_fallback", "pswpin", "pswpout")
# The file has ~170 "name value" lines and we want 11: one C-level scan for
# just those lines beats splitting every line in Python. A line counts if it
# is exactly two whitespace-separated tokens, the first a wanted name and the
# second an integer (what split() + int() accepted). The pattern starts with a
# literal newline (the text gets one prepended) so the scan can jump from line
# to line instead of trying every position.
_LINE = re.compile(r"\n[^\S\n]*(" + "|".join(map(re.escape, _FIELDS)) + r")[^\S\n]+([-+]?\d+)[^\S\n]*(?=\n|\Z)",
                   re.ASCII)
_METRIC = {name: f"vm.{name}" for name in _FIELDS}


@register
class VmstatCollector(Collector):
    name = "vmstat"
    cadence_ns = SLOW_CADENCE_NS

    def __init__(self, proc_root="/proc", sys_root="/sys"):
        super().__init__(proc_root, sys_root)
        self._deltas = CounterDeltas()
        self._path = self.proc("vmstat")

    def collect(self, now_ns: int) -> list[Sample]:
        text = self.read_text(self._path)
        if text is None:
            return []
        current = {(_METRIC[name], "all"): int(value) for name, value in _LINE.findall("\n" + text)}
        return self._deltas.samples(now_ns, current)
