"""Which rank sits behind a slow link: it wakes more often per collective than its peers.

A link that carries less slows a ring's every rank alike: each rank's collectives take as long as the
slowest hop, so neither the time inside them, their bandwidth nor the order of arrival at them tells the
ranks apart (dev scenario slow_link: latency p50 27 -> 151 ms and algbw 0.27 -> 0.05 GB/s on all three
ranks, arrival order naming no one). What differs is how the bytes reach the rank behind it. Its peers
receive each chunk from a fast hop in a burst; it receives its chunk as the slow hop lets it through,
in pieces, and its receiving thread blocks and wakes for each: more voluntary context switches per
collective than its peers (slow_link, 15-34 s against 37-59 s: 58-60 per collective on every rank
before; 70 and 70 against 94 on the rank behind the slow link during it).

One window is too few collectives to tell (4 a second there; a healthy rank's ratio to its peers reaches
1.44 in single windows). Summed over the last ``SPAN`` windows (the kept dev runs of stop 44): the top rank
of the three healthy runs stayed under 1.15 of its peers' median in every window; the rank behind the slow
link led every job-flagged window of the fault by 1.15 or more, 14 of 17 by ``MIN_RATIO``; and in the other
faults' runs the ratio passed MIN_RATIO in no window the job's rate flagged (it did in others: memcpy_stall's
copying rank in 21). So the scorer asks this only when the job's own rate says its iterations slowed and
neither the peer comparison, the order of arrival nor interrupt work named anyone (scoring.Scorer._flag_job).

What it needs and misses: the proc sampler's voluntary context switches (no eBPF) and the job's collective
rate (NCCL calls, or gloo's always-on marks). It sees transports whose receiving threads block in the
kernel (TCP: NCCL's socket transport, gloo). RDMA (InfiniBand, RoCE) bypasses the kernel and NCCL's proxy
threads poll: there a slow link leaves no trace here. A rank that wakes more by design (more threads, a
data loader) raises its ratio in every window, not only in a slowdown; only a strict minority of ranks
is ever named.
"""
from __future__ import annotations

import math
from collections import OrderedDict, deque
from statistics import median
from typing import Hashable, Mapping, Sequence

import numpy as np

from fleetscope.streams.model.checkpoint import JobPart
from fleetscope.streams.model.job_rate import job_rate
from fleetscope.streams.model.roles import finite

WAKEUPS = "proc_vol_ctx_per_s"
FEATURE = "link_wakeup_ratio"   # a rank's wakeups per collective over SPAN windows / its peers' median
SPAN = 5
MIN_RATIO = 1.2
MIN_RANKS = 3       # with two ranks, "more than its peer" names one of two: no minority
JOBS_KEPT = 10_000


class ReceiveWakeups:
    """Per job, each rank's wakeups and collectives of its last SPAN windows."""

    def __init__(self, span: int = SPAN, capacity: int = JOBS_KEPT):
        self.span, self.capacity = span, capacity
        self.recent: OrderedDict[Hashable, deque] = OrderedDict()

    def step(self, job: Hashable, ranks: Sequence[int], vectors: Sequence[Mapping[str, float]]) \
            -> list[float | None]:
        """Record one job step; each row's FEATURE, None until the job has SPAN windows or where unknown."""
        name, _ = job_rate(vectors)
        counts: dict[int, tuple[float, float]] = {}
        for rank, v in zip(ranks, vectors):
            woke, calls = v.get(WAKEUPS), v.get(name) if name else None
            if finite(woke) and woke >= 0 and finite(calls) and calls > 0:
                counts[int(rank)] = (float(woke), float(calls))
        recent = self.recent.get(job)
        if recent is None:
            recent = self.recent[job] = deque(maxlen=self.span)
        recent.append(counts)
        self.recent.move_to_end(job)
        while len(self.recent) > self.capacity:
            self.recent.popitem(last=False)
        if len(recent) < self.span:
            return [None] * len(ranks)
        seen = set.intersection(*(set(c) for c in recent))   # ranks counted in every window of the span
        if len(seen) < MIN_RANKS:
            return [None] * len(ranks)
        per_call = {r: sum(c[r][0] for c in recent) / sum(c[r][1] for c in recent) for r in seen}
        out: list[float | None] = []
        for rank in ranks:
            if int(rank) not in per_call:
                out.append(None)
                continue
            peers = median(x for r, x in per_call.items() if r != int(rank))
            out.append(per_call[int(rank)] / peers if peers > 0 else None)
        return out

    # ---- checkpoint part: the job's last SPAN windows, ranks x windows --------------------------------
    def part(self, job: tuple[str, str]) -> JobPart:
        return JobPart(self, job)

    def state(self, job: tuple[str, str]) -> tuple[dict, dict[str, np.ndarray]]:
        recent = list(self.recent.get(job, ()))
        ranks = sorted(set().union(*recent)) if recent else []
        woke = np.full((len(recent), len(ranks)), np.nan)
        calls = np.full((len(recent), len(ranks)), np.nan)
        for w, counts in enumerate(recent):
            for k, r in enumerate(ranks):
                if r in counts:
                    woke[w, k], calls[w, k] = counts[r]
        return {"windows": len(recent)}, {"ranks": np.array(ranks, dtype=np.int64), "wakeups": woke,
                                          "collectives": calls}

    def load(self, job: tuple[str, str], meta: dict, arrays) -> None:
        n = arrays.count(meta, "windows", self.span)
        ranks = arrays.take("ranks", "i8", (None,)).tolist()
        woke = arrays.take("wakeups", "f8", (n, len(ranks)))
        calls = arrays.take("collectives", "f8", (n, len(ranks)))
        recent: deque = deque(maxlen=self.span)
        for w in range(n):
            counts = {}
            for k, r in enumerate(ranks):
                if math.isnan(woke[w, k]) != math.isnan(calls[w, k]):
                    arrays.fail(f"window {w} rank {r}: wakeups and collectives not both known")
                if not math.isnan(woke[w, k]):
                    if not (woke[w, k] >= 0 and calls[w, k] > 0 and math.isfinite(woke[w, k] + calls[w, k])):
                        arrays.fail(f"window {w} rank {r}: counts out of range")
                    counts[int(r)] = (float(woke[w, k]), float(calls[w, k]))
            recent.append(counts)
        self.recent.pop(job, None)
        if recent:
            self.recent[job] = recent


def slow_receivers(ratios: Sequence[float | None]) -> list[int] | None:
    """The rows that wake clearly more per collective than their peers (FEATURE >= MIN_RATIO), when they are a
    strict minority of the rows compared; None otherwise."""
    compared = [i for i, x in enumerate(ratios) if x is not None]
    high = [i for i in compared if ratios[i] >= MIN_RATIO]
    if len(compared) < MIN_RANKS or not high or 2 * len(high) >= len(compared):
        return None
    return high
