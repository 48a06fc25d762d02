"""Virtual-memory event counters (NUMA placement, faults, THP, swap) from /proc/vmstat."""
from __future__ import annotations

from producers.host.collector import Collector, CounterDeltas, Sample, register

# Only the counters that explain slow training steps: remote-node allocations,
# major faults, THP fallbacks and swapping. Kernels without NUMA or THP lack
# some of them; those are just absent.
_FIELDS = ("numa_hit", "numa_miss", "numa_foreign", "numa_local", "numa_other", "pgfault",
           "pgmajfault", "thp_fault_alloc", "thp_fault_fallback", "pswpin", "pswpout")
_WANTED = frozenset(_FIELDS)


@register
class VmstatCollector(Collector):
    name = "vmstat"

    def __init__(self, proc_root="/proc", sys_root="/sys"):
        super().__init__(proc_root, sys_root)
        self._deltas = CounterDeltas()

    def collect(self, now_ns: int) -> list[Sample]:
        text = self.read_text(self.proc("vmstat"))
        if text is None:
            return []
        current = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] in _WANTED:
                try:
                    current[(f"vm.{parts[0]}", "all")] = int(parts[1])
                except ValueError:
                    continue
        return self._deltas.samples(now_ns, current)
