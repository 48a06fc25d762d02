"""Which ranks a change lands on, when it lands on some CPUs and not others.

A node-wide change (a process outside the job, memory pressure) reaches every rank of the host, and
`Scorer._attribute_node` gives them all role node; a job-wide one (its collective rate fell) gets role
job. Interrupt work does neither: it runs on the CPUs its IRQs (or, for softirqs, its RPS masks and
pinned senders) are steered to, and slows the ranks that run there. Their peers then wait for them in
each collective, often by too little for the order of arrival to say so (the dev scenario irq_storm:
the slowed rank arrived later by 0.01-0.04 of its window, under roles.MIN_GAP). The ranks' own CPUs say
it instead: `irq_time_rank_cpu_frac`, the interrupt-time share of the CPUs each rank ran on in the
window, joined per rank (streams/irq_features.py).

The ranks split at the widest gap between their shares, sorted. The ranks above it are local when
they are a strict minority, the gap is a real share of a CPU's time (LOCAL_MIN_GAP), and it is a
large part of their own share (LOCAL_REL_GAP). A gap, not a peer z: with three ranks on two CPUs, a
peer seen on both CPUs in the window sits halfway, and the median and MAD of (0, 0.075, 0.15) give
the flooded rank a z of 0.7 (measured in irq_storm, 3 of its 17 node windows).

A neighbour outside the job does the same when it is pinned beside one rank: the share of each rank's CPUs'
time that went to work outside the job (`outside_rank_cpu_frac`, streams/cpu_features.py) splits the host's
ranks the same way, with a wider gap (NeighbourPlacement).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Mapping, Sequence

import numpy as np

from fleetscope.streams.model.checkpoint import JobPart
from fleetscope.streams.model.roles import finite

LOCAL_FEATURE = "irq_time_rank_cpu_frac"
# The gap is at least 2 points of a CPU's time: on an idle host the shares are a few thousandths,
# and their differences are noise.
LOCAL_MIN_GAP = 0.02
# ...and at least 30% of the local ranks' own share: 0.15 against 0.12 is one load, not two.
LOCAL_REL_GAP = 0.3

MIN_COMPARED = 3   # ranks with the share: of two, neither is the odd one

OUTSIDE_FEATURE = "outside_rank_cpu_frac"
# A neighbour pinned to one rank's CPU: 0.30 of a CPU and 35% of the share above the others'. Measured in the dev
# scenarios (2 CPUs, 3 ranks): six busy loops pinned beside rank 0 (noisy_neighbour_pinned) gave its CPUs 0.71-0.89
# outside against its peers' 0.35-0.72, a gap of 0.36-0.51 in 25 of the 35 loaded windows; three loops free to
# move (outside_load_node) left gaps of at most 0.23 (0.66 against 0.43), healthy windows at most 0.24.
OUTSIDE_MIN_GAP = 0.3
OUTSIDE_REL_GAP = 0.35
PLACEMENTS_KEPT = 10_000


def local_rows(rows: Sequence[int], evidence: Sequence[Mapping[str, float]], feature: str = LOCAL_FEATURE,
               min_gap: float = LOCAL_MIN_GAP, rel_gap: float = LOCAL_REL_GAP) -> list[int]:
    """The rows (of `rows`) whose CPUs carry clearly more interrupt work (or `feature`) than the others'; []
    when none does, when fewer than three rows carry the share, or when the busier ones are not a strict
    minority of `rows`."""
    values = sorted(((float(evidence[i][feature]), i) for i in rows
                     if finite(evidence[i].get(feature))), reverse=True)
    if len(values) < MIN_COMPARED:
        return []   # of two, neither is the odd one
    # the widest gap between neighbours; of gaps about as wide, the highest (the fewest ranks above it)
    gaps = [values[k - 1][0] - values[k][0] for k in range(1, len(values))]
    cut = 1 + min(k for k, g in enumerate(gaps) if g >= 0.9 * max(gaps))
    gap, low_of_local = values[cut - 1][0] - values[cut][0], values[cut - 1][0]
    if gap < min_gap or gap < rel_gap * low_of_local or 2 * cut >= len(rows):
        return []
    return sorted(i for _, i in values[:cut])


class NeighbourPlacement:
    """Which ranks of a host a neighbour outside the job sits beside, remembered while its load lasts.

    A window whose CPU shares split (local_rows on `outside_rank_cpu_frac`) names the ranks and is remembered per
    (job, host); a window that does not split (a peer seen on the neighbour's CPU too sits halfway: 10 of the 35
    loaded windows of noisy_neighbour_pinned) keeps the named ranks while they still carry the most outside work
    of the host's ranks, ties included. ``forget`` when the host's outside load ends. Saved with the job's
    model (a checkpoint part, model/checkpoint.py): a restored worker keeps naming them through the windows
    that do not split."""

    def __init__(self, capacity: int = PLACEMENTS_KEPT):
        self.capacity = capacity
        self.ranks: OrderedDict[Hashable, frozenset] = OrderedDict()

    def place(self, key: Hashable, rows: Sequence[int], ranks: Sequence, evidence: Sequence[Mapping[str, float]]) \
            -> list[int]:
        """The rows (of `rows`, the host's ranks in this step; `ranks[i]` row i's rank) beside the neighbour."""
        local = local_rows(rows, evidence, OUTSIDE_FEATURE, OUTSIDE_MIN_GAP, OUTSIDE_REL_GAP)
        if local:
            self._remember(key, frozenset(ranks[i] for i in local))
            return local
        named = self.ranks.get(key)
        if not named:
            return []
        beside = [i for i in rows if ranks[i] in named]
        share = {i: float(evidence[i][OUTSIDE_FEATURE]) for i in rows if finite(evidence[i].get(OUTSIDE_FEATURE))}
        others = [share[i] for i in rows if i in share and i not in beside]
        if not beside or 2 * len(beside) >= len(rows) or any(i not in share for i in beside) \
                or (others and min(share[i] for i in beside) < max(others)):
            return []
        return beside

    def _remember(self, key: Hashable, ranks: frozenset) -> None:
        """The newest placement last; the oldest go past `capacity`."""
        self.ranks[key] = ranks
        self.ranks.move_to_end(key)
        while len(self.ranks) > self.capacity:
            self.ranks.popitem(last=False)

    def forget(self, key: Hashable) -> None:
        self.ranks.pop(key, None)

    # ---- checkpoint part: one job's named ranks, per host; keys are (tenant, job, host) --------------
    def part(self, job: tuple[str, str]) -> JobPart:
        return JobPart(self, job)

    def state(self, job: tuple[str, str]) -> tuple[dict, dict[str, np.ndarray]]:
        keys = [k for k in self.ranks if k[:2] == job]
        return {"hosts": [k[2] for k in keys]}, {f"ranks_{i}": np.array(sorted(self.ranks[k]), dtype=np.int64)
                                                 for i, k in enumerate(keys)}

    def load(self, job: tuple[str, str], meta: dict, arrays) -> None:
        hosts = meta.get("hosts") if isinstance(meta, dict) else None
        if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts) or len(hosts) > self.capacity:
            arrays.fail("hosts: not a list of host names")
        named = [frozenset(int(r) for r in arrays.take(f"ranks_{i}", "i8", (None,)).tolist())
                 for i in range(len(hosts))]
        for k in [k for k in self.ranks if k[:2] == job]:
            del self.ranks[k]
        for host, ranks in zip(hosts, named):
            if ranks:
                self._remember((*job, host), ranks)
