"""Raw batches of a 3-rank gloo job on one host, where processes outside the job start taking CPU.

Each 0.5 s tick has, per rank, a `proc` batch (its CPU time, as producers/process_sampler.py sends it) and a
`torch` batch (gloo collectives issued, the tracer's always-on marks), and the host's /proc/stat counters.
Shaped on the dev scenario outside_load_node as measured (the stack's kept store): the host busy 1.2 of its 2
cores, the ranks 0.55 of them together; from window `onset` the host is busy 2.0 cores while the ranks use
0.45, and the job issues 18% fewer collectives (the dev run lost 10%; 18% takes the job past
job_wide_slowdown's 1.15, so its `unless` rule is what keeps it out). No rank differs from its peers. Written here, not traced:
the ranks are rows, not processes.
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
                 job: str = "train"):
        self.t0, self.onset, self.end, self.tenant, self.job = t0_ns, onset, end, tenant, job
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
            out.append(self._rank_batch("proc", r, ts, [("proc.cpu_ns", f"pid{1000 + r}", rank_cores[r] * TICK, TICK)]))
            out.append(self._rank_batch("torch", r, ts, [("torch.coll_issued", "gloo", collectives * noise[RANKS + r],
                                                          TICK)]))
        busy = (2.0 if loaded else 1.2 * noise[-1]) * TICK / SEC
        out.append(self._host_batch(ts, busy, CORES * TICK / SEC - busy))
        return out

    def _rank_batch(self, source: str, rank: int, ts: int, rows) -> Batch:
        return rank_batch(source, HOST, self.tenant, self.job, rank, -1, ts, rows)

    def _host_batch(self, ts: int, busy_s: float, idle_s: float) -> Batch:
        names = ("cpu.user", "cpu.nice", "cpu.system", "cpu.idle", "cpu.iowait", "cpu.irq", "cpu.softirq", "cpu.steal",
                 "mem.total", "mem.available")
        values = (busy_s, 0.0, 0.0, max(idle_s, 0.0), 0.0, 0.0, 0.0, 0.0, 1000.0, 600.0)
        n = len(names)
        cols = {"ts_ns": np.full(n, ts, "<i8"), **node_identity(HOST, n), "metric": StrColumn.of(names),
                "device": StrColumn.constant("all", n), "value": np.array(values, "<f8"),
                "interval_ns": np.array([TICK] * 8 + [0, 0], "<i8")}
        return Batch("host", HOST, cols, created_ns=ts)
