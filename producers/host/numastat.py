"""Per-NUMA-node allocation counters from /sys/devices/system/node/node*/numastat."""
from __future__ import annotations

import os
import re

from producers.host.collector import Collector, CounterDeltas, Sample, register

_FIELDS = frozenset(("numa_hit", "numa_miss", "numa_foreign", "interleave_hit", "local_node", "other_node"))
_NODE_DIR = re.compile(r"node(\d+)$")


@register
class NumastatCollector(Collector):
    name = "numastat"

    def __init__(self, proc_root="/proc", sys_root="/sys"):
        super().__init__(proc_root, sys_root)
        self._deltas = CounterDeltas()

    def collect(self, now_ns: int) -> list[Sample]:
        base = self.sys("devices", "system", "node")
        try:
            nodes = sorted(n for n in os.listdir(base) if _NODE_DIR.match(n))
        except OSError as exc:
            self.warn_once("cannot list %s (%s): the kernel has no NUMA support here; "
                           "it reports nothing. Disable it by name to silence this.", base, exc.strerror or exc)
            return []
        current = {}
        for node in nodes:
            text = self.read_text(os.path.join(base, node, "numastat"))
            if text is None:
                continue
            for line in text.splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[0] in _FIELDS:
                    try:
                        current[(f"numa.{parts[0]}", node)] = int(parts[1])
                    except ValueError:
                        continue
        return self._deltas.samples(now_ns, current)
