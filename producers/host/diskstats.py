"""Block-device I/O counters from /proc/diskstats."""
from __future__ import annotations

import os

from fleetscope.producers.host.collector import SLOW_CADENCE_NS, Collector, CounterDeltas, Sample, register

# Virtual devices whose I/O is memory traffic, not disk traffic.
_SKIP_PREFIXES = ("loop", "ram", "zram")
# diskstats counts sectors of 512 bytes whatever the device's real sector size.
_SECTOR_BYTES = 512
# Positions after "major minor name" (Documentation/admin-guide/iostats.rst),
# with the scale that turns each into our unit.
_COLUMNS = {"disk.reads": (0, 1), "disk.read_bytes": (2, _SECTOR_BYTES),
            "disk.writes": (4, 1), "disk.write_bytes": (6, _SECTOR_BYTES), "disk.io_ms": (9, 1)}

_METRICS = tuple(_COLUMNS)
_SPECS = tuple(_COLUMNS.values())


@register
class DiskstatsCollector(Collector):
    name = "diskstats"
    cadence_ns = SLOW_CADENCE_NS

    def __init__(self, proc_root="/proc", sys_root="/sys"):
        super().__init__(proc_root, sys_root)
        self._deltas = CounterDeltas()
        self._path = self.proc("diskstats")
        self._block_dir = os.path.join(self.sys_root, "class", "block")
        # name -> is it a partition. A stat per device per tick was this
        # collector's main cost; an answer is kept while the device stays in
        # diskstats and asked again if it leaves and comes back (maybe as
        # something else under the same name).
        self._partition: dict[str, bool] = {}

    def _is_partition(self, name: str) -> bool:
        return os.path.exists(os.path.join(self._block_dir, name, "partition"))

    def collect(self, now_ns: int) -> list[Sample]:
        text = self.read_text(self._path)
        if text is None:
            return []
        current = {}
        known, seen = self._partition, {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) < 13 or parts[2].startswith(_SKIP_PREFIXES):
                continue
            name, fields = parts[2], parts[3:]
            partition = known.get(name)
            if partition is None:
                partition = self._is_partition(name)
            seen[name] = partition
            if partition:
                continue  # its I/O is already in its disk's line; summing both would count it twice
            try:
                # Scale before differencing is fine: deltas are linear.
                values = [int(fields[i]) * scale for i, scale in _SPECS]
            except ValueError:
                continue
            for metric, value in zip(_METRICS, values):
                current[(metric, name)] = value
        self._partition = seen
        return self._deltas.samples(now_ns, current)
