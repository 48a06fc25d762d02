"""Raw batches of a 6-rank NCCL job whose rank 4 turns into a straggler, as the tracers send them.

No GPU here: the cuda and nccl rows are the rows the cuda/nccl tracers emit (metric names, devices,
intervals), written by this module, not traced from a device. Ranks 0-2 run on node-a and 3-5 on node-b;
every 0.5 s tick has one cuda and one nccl batch per rank and each node's host counters. From window
`onset` rank 4 spends longer in cudaStreamSynchronize and reaches the collectives last, so it hardly waits
in them, while its peers wait a little longer: the knowledge base's straggler_rank pattern.
"""
from __future__ import annotations

import time

import numpy as np

from fleetscope.schema import node_identity
from fleetscope.wire import Batch, StrColumn
from support.rank_batches import rank_batch

SEC = 10**9
TICK = SEC // 2
RANKS = 6
STRAGGLER = 4


def recent_start_ns() -> int:
    """An hour-aligned start a day ago: inside the store's TTL and the worker's future-skew bound."""
    return (time.time_ns() // SEC // 3600 - 24) * 3600 * SEC


class StragglerJob:
    def __init__(self, t0_ns: int, onset: int, seed: int = 5, tenant: str = "acme", job: str = "train"):
        self.t0, self.onset, self.tenant, self.job = t0_ns, onset, tenant, job
        self.rng = np.random.default_rng(seed)

    @staticmethod
    def host_of(rank: int) -> str:
        return "node-a" if rank < 3 else "node-b"

    def tick(self, tick: int) -> list[Batch]:
        window = tick // 2
        ts = self.t0 + tick * TICK + TICK // 2
        out = []
        for r in range(RANKS):
            noise = 1 + 0.03 * self.rng.standard_normal(4)
            straggling = r == STRAGGLER and window >= self.onset
            nccl_frac = 0.06 if straggling else (0.33 if window >= self.onset else 0.30)
            sync_frac = 0.40 if straggling else 0.10
            calls = 20
            dur = nccl_frac * TICK * noise[0]
            p50 = dur / calls * noise[1]
            out.append(self._rank_batch("nccl", r, ts, [
                ("nccl.calls", "AllReduce", calls, TICK), ("nccl.bytes", "AllReduce", calls * 64e6, TICK),
                ("nccl.dur_ns", "AllReduce", dur, TICK), ("nccl.lat_p50_ns", "AllReduce", p50, 0),
                ("nccl.lat_p99_ns", "AllReduce", 1.5 * p50 * noise[2], 0)]))
            out.append(self._rank_batch("cuda", r, ts, [
                ("cuda.calls", "cudaLaunchKernel", 500 * noise[3], TICK),
                ("cuda.calls", "cudaStreamSynchronize", calls, TICK),
                ("cuda.dur_ns", "cudaStreamSynchronize", sync_frac * TICK * noise[2], TICK)]))
        out += [self._host_batch(h, ts) for h in ("node-a", "node-b")]
        return out

    def _rank_batch(self, source: str, rank: int, ts: int, rows) -> Batch:
        return rank_batch(source, self.host_of(rank), self.tenant, self.job, rank, rank % 3, ts, rows)

    def _host_batch(self, host: str, ts: int) -> Batch:
        names = ("cpu.user", "cpu.system", "cpu.idle", "cpu.steal", "mem.total", "mem.available")
        busy = 0.25 * (1 + 0.03 * self.rng.standard_normal())
        n = len(names)
        cols = {"ts_ns": np.full(n, ts, "<i8"), **node_identity(host, n), "metric": StrColumn.of(names),
                "device": StrColumn.constant("all", n), "value": np.array((busy, 0.05, 0.2, 0.0, 1000.0, 600.0), "<f8"),
                "interval_ns": np.array([TICK] * 4 + [0, 0], "<i8")}
        return Batch("host", host, cols, created_ns=ts)


class StoppedClock:
    """A processor's monotonic clock where flushes are forced: it never needs to move."""

    def __call__(self) -> float:
        return 0.0


def feed(proc, job: StragglerJob, windows: int, prefix: str = "fleetscope") -> None:
    """The job's batches for `windows` windows into the processor, as its worker would get them, one forced flush
    per 0.5 s tick."""
    from fleetscope.streams.processor import MessageRef
    from fleetscope.wire import encode
    offset = 0
    for tick in range(2 * windows):
        for batch in job.tick(tick):
            proc.handle(encode(batch), None, MessageRef(f"{prefix}.raw.{batch.source}", 0, offset))
            offset += 1
        proc.flush()
