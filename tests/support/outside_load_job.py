"""Raw batches of a 3-rank gloo job on one host, where processes outside the job start taking CPU.

Each 0.5 s tick has, per rank, a `proc` batch (its CPU time, as producers/process_sampler.py sends it) and a
`torch` batch (gloo collectives issued, the tracer's always-on marks), and the host's /proc/stat counters.
Shaped on the dev scenario outside_load_node as measured (the stack's kept store): the host busy 1.2 of its 2
cores, the ranks 0.55 of them together; from window `onset` the host is busy 2.0 cores while the ranks use
0.45, and the job issues 18% fewer collectives (the dev run lost 10%; 18% takes the job past
job_wide_slowdown's 1.15, so its `unless` rule is what keeps it out). No rank differs from its peers. Written here, not traced:
the ranks are rows, not processes.

`late_rank`: while loaded, that rank enters each gloo collective 30 ms after its peers (``torch.coll_entry_ns``
marks, as producers/tracers/gloo_marks.py sends them): the order of arrival alone would name it.

`placement` adds what the /proc samplers say of CPUs: each rank's last CPU (``proc.last_cpu``) and the host's
per-CPU counters. "spread": the neighbour's load lands on both CPUs alike and the ranks move between them, as
three free busy loops do (dev scenario outside_load_node). "pinned": the neighbour sits on cpu1 beside rank 0,
pinned there, while ranks 1 and 2 run on cpu0 (dev scenario noisy_neighbour_pinned, measured: cpu1 fully busy,
cpu0 0.65-0.9 busy, against about 0.5 each before; here the host is busy 1.75 cores then, not 2). "irq": the
ranks placed as in "pinned", the load on both CPUs alike, and a tenth of cpu1's time in softirq work, rank 0's.
"""
from __future__ import annotations

import numpy as np

from fleetscope.schema import node_identity
from fleetscope.wire import Batch, StrColumn
from support.rank_batches import rank_batch

SEC = 10**9
TICK = SEC // 2
RANKS = 3
HOST = "node-a"
CORES = 2


class OutsideLoadJob:
    def __init__(self, t0_ns: int, onset: int, end: int | None = None, seed: int = 7, tenant: str = "acme",
                 job: str = "train", placement: str | None = None, late_rank: int | None = None):
        assert placement in (None, "spread", "pinned", "irq"), placement
        self.late_rank = late_rank
        self.t0, self.onset, self.end, self.tenant, self.job = t0_ns, onset, end, tenant, job
        self.placement = placement
        # pinned: the neighbour has cpu1 and the rest of the host's work cpu0, which it does not fill
        self.loaded_cores = 1.75 if placement == "pinned" else 2.0
        self.rng = np.random.default_rng(seed)

    def loaded(self, window: int) -> bool:
        return window >= self.onset and (self.end is None or window < self.end)

    def tick(self, tick: int) -> list[Batch]:
        window = tick // 2
        ts = self.t0 + tick * TICK + TICK // 2
        loaded = self.loaded(window)
        noise = 1 + 0.03 * self.rng.standard_normal(2 * RANKS + 1)
        rank_cores = (0.15 if loaded else 0.183) * noise[:RANKS]
        collectives = (20.5 if loaded else 25.0) * TICK / SEC
        out = []
        for r in range(RANKS):
            proc = [("proc.cpu_ns", f"pid{1000 + r}", rank_cores[r] * TICK, TICK)]
            if self.placement is not None:
                proc.append(("proc.last_cpu", f"cpu{self._cpu_of(r, tick, loaded)}", 1.0, 0))
            out.append(self._rank_batch("proc", r, ts, proc))
            torch = [("torch.coll_issued", "gloo", collectives * noise[RANKS + r], TICK)]
            if self.late_rank is not None:
                late = 30 * 10**6 if r == self.late_rank and loaded else 0
                n = int(round(collectives))
                start = self.t0 + tick * TICK
                torch += [("torch.coll_entry_ns", f"gloo0#{tick * 100 + j}", float(start + j * TICK // n + late), 0)
                          for j in range(n)]
            out.append(self._rank_batch("torch", r, ts, torch))
        busy = (self.loaded_cores if loaded else 1.2 * noise[-1]) * TICK / SEC
        softirq = [0.0, 0.1 * TICK / SEC] if self.placement == "irq" and loaded else [0.0] * CORES
        out.append(self._host_batch(ts, busy, CORES * TICK / SEC - busy, self._per_cpu_busy(busy, loaded), softirq))
        return out

    def _cpu_of(self, rank: int, tick: int, loaded: bool) -> int:
        if self.placement in ("pinned", "irq") and loaded:
            return 1 if rank == 0 else 0
        return (rank + tick) % CORES   # free to move: each rank on either CPU in turn

    def _per_cpu_busy(self, busy_s: float, loaded: bool) -> list[float]:
        """Each CPU's busy seconds in the tick, adding up to the host's."""
        if self.placement == "pinned" and loaded:
            return [busy_s - TICK / SEC, TICK / SEC]   # cpu1 fully busy, cpu0 the rest
        return [busy_s / CORES] * CORES

    def _rank_batch(self, source: str, rank: int, ts: int, rows) -> Batch:
        return rank_batch(source, HOST, self.tenant, self.job, rank, -1, ts, rows)

    def _host_batch(self, ts: int, busy_s: float, idle_s: float, per_cpu: list[float], softirq: list[float]) -> Batch:
        states = ("cpu.user", "cpu.nice", "cpu.system", "cpu.idle", "cpu.iowait", "cpu.irq", "cpu.softirq", "cpu.steal")
        rows = [(name, "all", value, TICK) for name, value in zip(states, (busy_s, 0.0, 0.0, max(idle_s, 0.0)))]
        rows += [(name, "all", 0.0, TICK) for name in states[4:]]
        if self.placement is not None:
            for cpu, b in enumerate(per_cpu):
                rows += [("cpu.user", f"cpu{cpu}", b - softirq[cpu], TICK), ("cpu.softirq", f"cpu{cpu}", softirq[cpu], TICK),
                         ("cpu.idle", f"cpu{cpu}", max(TICK / SEC - b, 0.0), TICK)]
                rows += [(name, f"cpu{cpu}", 0.0, TICK) for name in states
                         if name not in ("cpu.user", "cpu.idle", "cpu.softirq")]
        rows += [("mem.total", "all", 1000.0, 0), ("mem.available", "all", 600.0, 0)]
        n = len(rows)
        names, devices, values, intervals = zip(*rows)
        cols = {"ts_ns": np.full(n, ts, "<i8"), **node_identity(HOST, n), "metric": StrColumn.of(names),
                "device": StrColumn.of(devices), "value": np.array(values, "<f8"),
                "interval_ns": np.array(intervals, "<i8")}
        return Batch("host", HOST, cols, created_ns=ts)
