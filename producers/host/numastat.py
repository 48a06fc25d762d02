"""Per-NUMA-node allocation counters from /sys/devices/system/node/node*/numastat."""
from __future__ import annotations

import os
import re

from fleetscope.producers.host.collector import SLOW_CADENCE_NS, Collector, CounterDeltas, Sample, register

_FIELDS = frozenset(("numa_hit", "numa_miss", "numa_foreign", "interleave_hit", "local_node", "other_node"))
_NODE_DIR = re.compile(r"node(\d+)$")
_METRIC = {name: f"numa.{name}" for name in _FIELDS}


@register
class NumastatCollector(Collector):
    name = "numastat"
    cadence_ns = SLOW_CADENCE_NS

    def __init__(self, proc_root="/proc", sys_root="/sys"):
        super().__init__(proc_root, sys_root)
        self._deltas = CounterDeltas()
        self._base = self.sys("devices", "system", "node")
        self._paths: dict[str, str] = {}  # "nodeN" -> its numastat path

    def collect(self, now_ns: int) -> list[Sample]:
        base = self._base
        try:
            nodes = sorted(n for n in os.listdir(base) if _NODE_DIR.match(n))
        except OSError as exc:
            self.warn_once("cannot list %s (%s): the kernel has no NUMA support here; "
                           "it reports nothing. Disable it by name to silence this.", base, exc.strerror or exc)
            return []
        current = {}
        paths = self._paths
        for node in nodes:
            path = paths.get(node)
            if path is None:
                path = paths[node] = os.path.join(base, node, "numastat")
            text = self.read_text(path)
            if text is None:
                continue
            for line in text.splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[0] in _FIELDS:
                    try:
                        current[(_METRIC[parts[0]], node)] = int(parts[1])
                    except ValueError:
                        continue
        return self._deltas.samples(now_ns, current)
