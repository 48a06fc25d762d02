"""CPU time, context switches and run-queue gauges from /proc/stat."""
from __future__ import annotations

import os

from fleetscope.producers.host.collector import Collector, CounterDeltas, Sample, make_sample, register

# Column order of the cpu lines (see proc(5)). guest and guest_nice are left
# out on purpose: the kernel already counts them inside user and nice, so
# adding them would count that time twice.
_CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
_CPU_METRICS = tuple(f"cpu.{field}" for field in _CPU_FIELDS)
_NFIELDS = len(_CPU_FIELDS)
_GAUGES = {"procs_running": "cpu.procs_running", "procs_blocked": "cpu.procs_blocked"}
_WANTED_PREFIXES = ("cpu", "ctxt", "procs_")


@register
class CpuStatCollector(Collector):
    name = "cpu"

    def __init__(self, proc_root="/proc", sys_root="/sys"):
        super().__init__(proc_root, sys_root)
        # /proc/stat counts in USER_HZ ticks; the divisor makes deltas seconds.
        self._seconds_per_tick = 1.0 / os.sysconf("SC_CLK_TCK")
        self._times = CounterDeltas()
        self._ctxt = CounterDeltas()
        self._path = self.proc("stat")

    def collect(self, now_ns: int) -> list[Sample]:
        text = self.read_text(self._path)
        if text is None:
            return []
        times: dict[tuple[str, str], float] = {}
        ctxt: dict[tuple[str, str], float] = {}
        gauges: list[Sample] = []
        for line in text.splitlines():
            # Only the lines we use are split: "intr" alone holds a count per
            # IRQ number (hundreds to thousands of tokens) and "softirq" ten.
            if not line.startswith(_WANTED_PREFIXES):
                continue
            parts = line.split()
            if len(parts) < 2:
                continue
            head = parts[0]
            try:
                if head.startswith("cpu"):
                    # "cpu" is the machine total; "cpuN" lines exist only for
                    # online CPUs, so a CPU that is offline simply has no keys
                    # and CounterDeltas skips it the tick it comes back.
                    device = "all" if head == "cpu" else head
                    values = list(map(int, parts[1:1 + _NFIELDS]))
                    for metric, value in zip(_CPU_METRICS, values):
                        times[(metric, device)] = value
                elif head == "ctxt":
                    ctxt[("cpu.context_switches", "all")] = int(parts[1])
                elif head in _GAUGES:
                    gauges.append(make_sample((_GAUGES[head], "all", float(parts[1]), 0)))
            except ValueError:
                continue  # a malformed line costs that line, not the whole file
        return (self._times.samples(now_ns, times, self._seconds_per_tick)
                + self._ctxt.samples(now_ns, ctxt) + gauges)
