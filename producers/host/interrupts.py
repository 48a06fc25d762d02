"""Per-CPU interrupt counts from /proc/interrupts.

The file is a table: a header naming the online CPUs ("CPU0 CPU2 ..."), then
one row per interrupt source: "<irq>: <count per CPU> <chip and description>".
Descriptions can hold bare numbers (ARM: "GICv3  27 Level  arch_timer"), so a
row contributes at most one number per header column. Some rows (x86 ERR,
MIS) carry a single machine-wide number and no description.

A big GPU node has ~200 CPUs and ~1500 rows, i.e. 300k cells a tick, so the
cells live in a numpy matrix and deltas are array arithmetic; only the few
cells that moved become Python objects.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from producers.host.collector import Collector, Sample, register

_MISSING = -1  # a cell the row did not have (short rows); never yields a delta


@dataclass
class InterruptTable:
    cpus: list[str]                 # "cpu<N>" per column, from the header
    irqs: list[str]                 # per-CPU rows (full rows first, then short ones)
    counts: np.ndarray              # int64 [len(irqs), len(cpus)], _MISSING where absent
    totals: dict[str, int]          # single-number rows: irq -> machine-wide count


def parse_interrupts(text: str) -> InterruptTable:
    lines = text.splitlines()
    header = next((i for i, line in enumerate(lines) if line.strip()), None)
    if header is None:
        return InterruptTable([], [], np.empty((0, 0), dtype=np.int64), {})
    # Offline CPUs have no column, so the column -> CPU map comes from the header.
    cpus = [f"cpu{tok[3:]}" for tok in lines[header].split() if tok.startswith("CPU") and tok[3:].isdigit()]
    ncpu = len(cpus)
    if not ncpu:  # without a header there is no way to tell which CPU a number belongs to
        return InterruptTable([], [], np.empty((0, 0), dtype=np.int64), {})
    # Full rows (the vast majority) are kept as text and converted in one
    # numpy call: int() per cell was most of this collector's cost.
    full_irqs, full_text = [], []
    short_irqs, short_rows, totals = [], [], {}
    for line in lines[header + 1:]:
        name, sep, rest = line.partition(":")
        irq = name.strip()
        if not sep or not irq:
            continue
        tokens = rest.split(None, ncpu)  # the description stays in one piece
        head = tokens[:ncpu]
        # With one CPU, "ERR: 0" (machine-wide, no description) looks like a
        # full row; the description is what tells a per-CPU row apart.
        if len(head) == ncpu and (ncpu > 1 or len(tokens) > 1) and "".join(head).isdigit():
            full_irqs.append(irq)
            full_text.append(" ".join(head))
            continue
        counts = []
        for tok in head:
            if not tok.isdigit():
                break
            counts.append(int(tok))
        if not counts:
            continue
        described = len(tokens) > len(counts)
        if len(counts) == 1 and (ncpu > 1 or not described):
            totals[irq] = counts[0]
        else:
            short_irqs.append(irq)
            short_rows.append(counts + [_MISSING] * (ncpu - len(counts)))
    full = np.fromstring(" ".join(full_text), dtype=np.int64, sep=" ") if full_text else np.empty(0, np.int64)
    matrix = np.vstack([full.reshape(len(full_irqs), ncpu),
                        np.array(short_rows, dtype=np.int64).reshape(len(short_rows), ncpu)])
    irqs = full_irqs + short_irqs
    return InterruptTable(cpus, irqs, matrix, totals)


@register
class InterruptsCollector(Collector):
    name = "interrupts"

    def __init__(self, proc_root="/proc", sys_root="/sys"):
        super().__init__(proc_root, sys_root)
        self._prev: InterruptTable | None = None
        self._prev_ns = 0

    def collect(self, now_ns: int) -> list[Sample]:
        text = self.read_text(self.proc("interrupts"))
        if text is None:
            return []
        cur, prev, prev_ns = parse_interrupts(text), self._prev, self._prev_ns
        self._prev, self._prev_ns = cur, now_ns
        if prev is None or now_ns <= prev_ns:
            return []
        interval_ns = now_ns - prev_ns
        out = []
        # Align by name, not position: a CPU going offline removes a column,
        # a freed IRQ removes a row. Only cells present in both snapshots count.
        prev_row = {irq: i for i, irq in enumerate(prev.irqs)}
        prev_col = {cpu: j for j, cpu in enumerate(prev.cpus)}
        rows = [(i, prev_row[irq]) for i, irq in enumerate(cur.irqs) if irq in prev_row]
        cols = [(j, prev_col[cpu]) for j, cpu in enumerate(cur.cpus) if cpu in prev_col]
        if cols:
            now_cells = cur.counts[np.ix_([r for r, _ in rows], [c for c, _ in cols])]
            old_cells = prev.counts[np.ix_([r for _, r in rows], [c for _, c in cols])]
            delta = now_cells - old_cells
            # Missing cells and counters that went backwards (a reset) give no delta.
            valid = (now_cells != _MISSING) & (old_cells != _MISSING) & (delta >= 0)
            delta = np.where(valid, delta, 0)
            # Most (irq, cpu) cells never move; sending their zeros would dwarf the rest.
            for r, c in zip(*np.nonzero(delta)):
                device = f"{cur.irqs[rows[r][0]]}@{cur.cpus[cols[c][0]]}"
                out.append(Sample("irq.count", device, float(delta[r, c]), interval_ns))
            # Every CPU seen in both snapshots gets a total, zero included, so a
            # quiet CPU is visibly quiet rather than missing.
            for c, total in enumerate(delta.sum(axis=0).tolist()):
                out.append(Sample("irq.cpu_total", cur.cpus[cols[c][0]], float(total), interval_ns))
        for irq, count in cur.totals.items():
            old = prev.totals.get(irq)
            if old is not None and count > old:
                out.append(Sample("irq.count", f"{irq}@all", float(count - old), interval_ns))
        return out
