"""Memory gauges from /proc/meminfo."""
from __future__ import annotations

import re

from fleetscope.producers.host.collector import SLOW_CADENCE_NS, Collector, Sample, make_sample, register

# /proc/meminfo field -> our metric. Values with a "kB" unit become bytes;
# the HugePages_* fields have no unit because they are page counts, and stay so.
_FIELDS = {
    "MemTotal": "mem.total", "MemFree": "mem.free", "MemAvailable": "mem.available",
    "Buffers": "mem.buffers", "Cached": "mem.cached", "AnonPages": "mem.anon",
    "AnonHugePages": "mem.anon_huge", "ShmemHugePages": "mem.shmem_huge",
    "HugePages_Total": "mem.hugepages_total", "HugePages_Free": "mem.hugepages_free",
    "HugePages_Rsvd": "mem.hugepages_rsvd", "Hugepagesize": "mem.hugepage_size",
    "Dirty": "mem.dirty", "Writeback": "mem.writeback",
}

# One C-level scan for the wanted lines only ("Key:  value [unit]"), instead
# of partitioning and splitting all ~55 lines in Python. Same rule as before:
# the key (whitespace-trimmed) must be one of ours, the first token after the
# colon is the value and the second, if any, the unit. The leading literal
# newline (one is prepended to the text) lets the scan jump between lines.
_LINE = re.compile(r"\n[^\S\n]*(" + "|".join(map(re.escape, _FIELDS)) + r")[^\S\n]*:[^\S\n]*(\S+)(?:[^\S\n]+(\S+))?",
                   re.ASCII)


@register
class MeminfoCollector(Collector):
    name = "meminfo"
    cadence_ns = SLOW_CADENCE_NS

    def __init__(self, proc_root="/proc", sys_root="/sys"):
        super().__init__(proc_root, sys_root)
        self._path = self.proc("meminfo")

    def collect(self, now_ns: int) -> list[Sample]:
        text = self.read_text(self._path)
        if text is None:
            return []
        out = []
        for key, raw, unit in _LINE.findall("\n" + text):
            try:
                value = float(raw)
            except ValueError:
                continue
            if unit and unit.lower() == "kb":
                value *= 1024
            out.append(make_sample((_FIELDS[key], "all", value, 0)))
        return out
