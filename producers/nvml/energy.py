"""A job's energy: each process's share of its GPU's energy, per tick.

The agent is the one place that sees a device's energy counter and the
per-process SM utilization of the same tick, so the split happens here and
the rows carry the rank's identity; the stream worker then only sums joules
per rank and window. Shares follow SM utilization. When NVML has no
utilization samples for a tick but processes hold the GPU, they share it
equally: the energy was spent, and dropping it would hide it.
"""
from __future__ import annotations


def split_energy(joules: float, sm_util: dict[int, float], present: set[int]) -> dict[int, float]:
    """pid -> joules. `sm_util` is pid -> SM utilization %, `present` the pids on the GPU."""
    pids = set(present) | set(sm_util)
    if not pids or joules <= 0:
        return {}
    total = sum(max(sm_util.get(p, 0.0), 0.0) for p in pids)
    if total <= 0:
        return {p: joules / len(pids) for p in pids}
    return {p: joules * max(sm_util.get(p, 0.0), 0.0) / total for p in pids}
