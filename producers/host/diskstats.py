"""Block-device I/O counters from /proc/diskstats."""
from __future__ import annotations

import os

from producers.host.collector import Collector, CounterDeltas, Sample, register

# Virtual devices whose I/O is memory traffic, not disk traffic.
_SKIP_PREFIXES = ("loop", "ram", "zram")
# diskstats counts sectors of 512 bytes whatever the device's real sector size.
_SECTOR_BYTES = 512
# Positions after "major minor name" (Documentation/admin-guide/iostats.rst),
# with the scale that turns each into our unit.
_COLUMNS = {"disk.reads": (0, 1), "disk.read_bytes": (2, _SECTOR_BYTES),
            "disk.writes": (4, 1), "disk.write_bytes": (6, _SECTOR_BYTES), "disk.io_ms": (9, 1)}


@register
class DiskstatsCollector(Collector):
    name = "diskstats"

    def __init__(self, proc_root="/proc", sys_root="/sys"):
        super().__init__(proc_root, sys_root)
        self._deltas = CounterDeltas()

    def _is_partition(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.sys_root, "class", "block", name, "partition"))

    def collect(self, now_ns: int) -> list[Sample]:
        text = self.read_text(self.proc("diskstats"))
        if text is None:
            return []
        current = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) < 13 or parts[2].startswith(_SKIP_PREFIXES):
                continue
            name, fields = parts[2], parts[3:]
            if self._is_partition(name):
                continue  # its I/O is already in its disk's line; summing both would count it twice
            try:
                for metric, (i, scale) in _COLUMNS.items():
                    # Scale before differencing is fine: deltas are linear.
                    current[(metric, name)] = int(fields[i]) * scale
            except ValueError:
                continue
        return self._deltas.samples(now_ns, current)
