"""Memory gauges from /proc/meminfo."""
from __future__ import annotations

from producers.host.collector import Collector, Sample, register

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


@register
class MeminfoCollector(Collector):
    name = "meminfo"

    def collect(self, now_ns: int) -> list[Sample]:
        text = self.read_text(self.proc("meminfo"))
        if text is None:
            return []
        out = []
        for line in text.splitlines():
            key, _, rest = line.partition(":")
            metric = _FIELDS.get(key.strip())
            if metric is None:
                continue
            parts = rest.split()
            try:
                value = float(parts[0])
            except (IndexError, ValueError):
                continue
            if len(parts) > 1 and parts[1].lower() == "kb":
                value *= 1024
            out.append(Sample(metric, "all", value, 0))
        return out
