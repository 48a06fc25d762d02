"""Per-CPU interrupt counts from /proc/interrupts.

The file is a table: a header naming the online CPUs ("CPU0 CPU2 ..."), then
one row per interrupt source: "<irq>: <count per CPU> <chip and description>".
Descriptions can hold bare numbers (ARM: "GICv3  27 Level  arch_timer"), so a
row contributes at most one number per header column. Some rows (x86 ERR,
MIS) carry a single machine-wide number and no description.

A big GPU node has ~200 CPUs and ~1500 rows, i.e. 300k cells a tick, so the
cells live in a numpy matrix and deltas are array arithmetic; only the few
cells that moved become Python objects.

It runs once a second (SLOW_CADENCE_NS), not every tick: the kernel alone
spends more generating this file than any other we read (a per-CPU count for
every IRQ line), and parsing it was a third of the host sampler's CPU at a
100 ms tick. Its use is window-scale (interrupt rates per CPU and machine
wide), and a delta over one second loses no interrupt, only resolution below
the stream's windows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from fleetscope.producers.host.collector import SLOW_CADENCE_NS, Collector, Sample, make_sample, register

_MISSING = -1  # a cell the row did not have (short rows); never yields a delta
_PY_CELLS = 4096  # changed cells up to which deltas are taken in Python rather than numpy


@dataclass
class InterruptTable:
    cpus: list[str]                 # "cpu<N>" per column, from the header
    irqs: list[str]                 # per-CPU rows (full rows first, then short ones)
    counts: np.ndarray              # int64 [len(irqs), len(cpus)], _MISSING where absent
    totals: dict[str, int]          # single-number rows: irq -> machine-wide count
    has_missing: bool = False       # any _MISSING cell (i.e. any short row)


class _Rows(NamedTuple):
    """One read of the file, split into rows but not yet into numbers."""
    cpus: list[str]
    full_irqs: list[str]
    full_text: list[str]            # per full row: its ncpu counts, space-separated
    short_irqs: list[str]
    short_rows: list[list[int]]     # padded with _MISSING to ncpu
    totals: dict[str, int]


_NO_ROWS = _Rows([], [], [], [], [], {})


def parse_interrupts(text: str) -> InterruptTable:
    return _table(_rows(text))


def _table(rows: _Rows) -> InterruptTable:
    cpus, full_irqs, full_text, short_irqs, short_rows, totals = rows
    ncpu = len(cpus)
    if not ncpu:
        return InterruptTable([], [], np.empty((0, 0), dtype=np.int64), {})
    full = np.fromstring(" ".join(full_text), dtype=np.int64, sep=" ") if full_text else np.empty(0, np.int64)
    matrix = full.reshape(len(full_irqs), ncpu)
    if short_rows:
        matrix = np.vstack([matrix, np.array(short_rows, dtype=np.int64).reshape(len(short_rows), ncpu)])
    return InterruptTable(cpus, full_irqs + short_irqs, matrix, totals, bool(short_rows))


def _rows(text: str) -> _Rows:
    lines = text.splitlines()
    header = next((i for i, line in enumerate(lines) if line.strip()), None)
    if header is None:
        return _NO_ROWS
    # Offline CPUs have no column, so the column -> CPU map comes from the header.
    cpus = [f"cpu{tok[3:]}" for tok in lines[header].split() if tok.startswith("CPU") and tok[3:].isdigit()]
    ncpu = len(cpus)
    if not ncpu:  # without a header there is no way to tell which CPU a number belongs to
        return _NO_ROWS
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
    return _Rows(cpus, full_irqs, full_text, short_irqs, short_rows, totals)


@register
class InterruptsCollector(Collector):
    name = "interrupts"
    cadence_ns = SLOW_CADENCE_NS

    def __init__(self, proc_root="/proc", sys_root="/sys"):
        super().__init__(proc_root, sys_root)
        self._prev_rows: _Rows | None = None
        self._prev_ns = 0
        self._path = self.proc("interrupts")

    def collect(self, now_ns: int) -> list[Sample]:
        text = self.read_text(self._path)
        if text is None:
            return []
        rows, prev, prev_ns = _rows(text), self._prev_rows, self._prev_ns
        self._prev_rows, self._prev_ns = rows, now_ns
        if prev is None or now_ns <= prev_ns:
            return []
        interval_ns = now_ns - prev_ns
        if (rows.cpus and rows.cpus == prev.cpus and rows.full_irqs == prev.full_irqs
                and rows.short_irqs == prev.short_irqs):
            out = _same_layout_deltas(rows, prev, interval_ns)
        else:
            out = _aligned_deltas(_table(rows), _table(prev), interval_ns)
        for irq, count in rows.totals.items():
            old = prev.totals.get(irq)
            if old is not None and count > old:
                out.append(make_sample(("irq.count", f"{irq}@all", float(count - old), interval_ns)))
        return out


def _same_layout_deltas(cur: _Rows, prev: _Rows, interval_ns: int) -> list[Sample]:
    """The usual tick: the same CPUs and rows as last time, in the same order.

    A row whose text did not change has a zero delta in every cell, and most
    rows on most ticks do not change, so only the rows that did are turned
    into numbers. Output order is that of the aligned path: full rows then
    short rows, row-major, then the per-CPU totals.
    """
    cpus, irqs = cur.cpus, cur.full_irqs
    out: list[Sample] = []
    col_totals = [0] * len(cpus)
    changed = [i for i, (a, b) in enumerate(zip(cur.full_text, prev.full_text)) if a != b]
    if changed and len(changed) * len(cpus) <= _PY_CELLS:
        # Few cells: plain Python beats the fixed cost of a dozen numpy calls
        # (which is large right after the agent wakes, with cold caches).
        for i in changed:
            irq = irqs[i]
            for j, (a, b) in enumerate(zip(cur.full_text[i].split(), prev.full_text[i].split())):
                if a != b and (d := int(a) - int(b)) > 0:  # backwards (a reset) gives no delta
                    out.append(make_sample(("irq.count", f"{irq}@{cpus[j]}", float(d), interval_ns)))
                    col_totals[j] += d
    elif changed:
        shape = (len(changed), len(cpus))
        now = np.fromstring(" ".join([cur.full_text[i] for i in changed]), dtype=np.int64, sep=" ").reshape(shape)
        old = np.fromstring(" ".join([prev.full_text[i] for i in changed]), dtype=np.int64, sep=" ").reshape(shape)
        delta = now - old
        np.maximum(delta, 0, out=delta)  # a counter that went backwards (a reset) gives no delta
        r_idx, c_idx = np.nonzero(delta)
        out = [make_sample(("irq.count", f"{irqs[changed[r]]}@{cpus[c]}", v, interval_ns)) for r, c, v in
               zip(r_idx.tolist(), c_idx.tolist(), delta[r_idx, c_idx].astype(np.float64).tolist())]
        col_totals = delta.sum(axis=0).tolist()
    for irq, now_row, old_row in zip(cur.short_irqs, cur.short_rows, prev.short_rows):
        for j, (a, b) in enumerate(zip(now_row, old_row)):
            # Missing cells give no delta, nor do counters that went backwards.
            if a > b and b != _MISSING:
                out.append(make_sample(("irq.count", f"{irq}@{cpus[j]}", float(a - b), interval_ns)))
                col_totals[j] += a - b
    # Every CPU gets a total, zero included, so a quiet CPU is visibly quiet rather than missing.
    out += [make_sample(("irq.cpu_total", cpu, float(total), interval_ns)) for cpu, total in zip(cpus, col_totals)]
    return out


def _aligned_deltas(cur: InterruptTable, prev: InterruptTable, interval_ns: int) -> list[Sample]:
    out: list[Sample] = []
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
            out.append(make_sample(("irq.count", device, float(delta[r, c]), interval_ns)))
        # Every CPU seen in both snapshots gets a total, zero included, so a
        # quiet CPU is visibly quiet rather than missing.
        for c, total in enumerate(delta.sum(axis=0).tolist()):
            out.append(make_sample(("irq.cpu_total", cur.cpus[cols[c][0]], float(total), interval_ns)))
    return out
