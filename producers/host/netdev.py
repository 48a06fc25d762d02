"""Per-interface traffic counters from /proc/net/dev."""
from __future__ import annotations

from fleetscope.producers.host.collector import Collector, CounterDeltas, Sample, register

# Positions in the 16 numbers after "iface:" (8 receive, then 8 transmit).
_COLUMNS = {"net.rx_bytes": 0, "net.rx_packets": 1, "net.rx_errs": 2, "net.rx_drop": 3,
            "net.tx_bytes": 8, "net.tx_packets": 9, "net.tx_errs": 10, "net.tx_drop": 11}

_METRICS = tuple(_COLUMNS)
_INDEXES = tuple(_COLUMNS.values())


@register
class NetdevCollector(Collector):
    name = "netdev"

    def __init__(self, proc_root="/proc", sys_root="/sys"):
        super().__init__(proc_root, sys_root)
        self._deltas = CounterDeltas()
        self._path = self.proc("net", "dev")

    def collect(self, now_ns: int) -> list[Sample]:
        text = self.read_text(self._path)
        if text is None:
            return []
        current = {}
        for line in text.splitlines():
            # Interface names cannot contain ':', but old kernels glue a large
            # byte count to it ("eth0:123456"), so split on ':' not whitespace.
            iface, sep, rest = line.partition(":")
            if not sep or "|" in line:  # the two header lines
                continue
            iface = iface.strip()
            fields = rest.split()
            if len(fields) < 12:
                continue
            try:
                values = [int(fields[i]) for i in _INDEXES]
            except ValueError:
                continue
            for metric, value in zip(_METRICS, values):
                current[(metric, iface)] = value
        return self._deltas.samples(now_ns, current)
