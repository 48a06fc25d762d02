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
"""
from __future__ import annotations

from typing import Mapping, Sequence

from fleetscope.streams.model.roles import finite

LOCAL_FEATURE = "irq_time_rank_cpu_frac"
# The gap is at least 2 points of a CPU's time: on an idle host the shares are a few thousandths,
# and their differences are noise.
LOCAL_MIN_GAP = 0.02
# ...and at least 30% of the local ranks' own share: 0.15 against 0.12 is one load, not two.
LOCAL_REL_GAP = 0.3


def local_rows(rows: Sequence[int], evidence: Sequence[Mapping[str, float]]) -> list[int]:
    """The rows (of `rows`) whose CPUs carry clearly more interrupt work than the others'; [] when none
    does, when fewer than three rows carry the share, or when the busier ones are not a strict minority
    of `rows`."""
    values = sorted(((float(evidence[i][LOCAL_FEATURE]), i) for i in rows
                     if finite(evidence[i].get(LOCAL_FEATURE))), reverse=True)
    if len(values) < 3:
        return []   # of two, neither is the odd one
    # the widest gap between neighbours; of gaps about as wide, the highest (the fewest ranks above it)
    gaps = [values[k - 1][0] - values[k][0] for k in range(1, len(values))]
    cut = 1 + min(k for k, g in enumerate(gaps) if g >= 0.9 * max(gaps))
    gap, low_of_local = values[cut - 1][0] - values[cut][0], values[cut - 1][0]
    if gap < LOCAL_MIN_GAP or gap < LOCAL_REL_GAP * low_of_local or 2 * cut >= len(rows):
        return []
    return sorted(i for _, i in values[:cut])
