"""Where on a node's CPUs work runs: each CPU's busy share, the CPUs a rank ran on, and how much of its CPUs'
time went to work outside its job.

A neighbour pinned to one CPU (another tenant's process, a daemon with an affinity mask) takes that CPU from
the rank that runs there, not from the node: its peers wait for it in each collective, and the host's outside
load (model/outside_load.py) says only that someone outside the job got busier. Which rank it sits beside is
in the per-CPU counters:

    outside on CPU c       = c's busy share - the job's ranks' own CPU there
                             (each rank's `proc_cpu_cores` spread evenly over the CPUs it was seen on)
    outside_rank_cpu_frac  = the mean of that over the rank's CPUs

The rank's CPUs are the ones the /proc sampler saw its main thread last run on in the window
(``proc.last_cpu``, device ``cpu<N>``; sampled at most every second): a rank pinned to a CPU is seen exactly,
an unpinned one approximately, and one seen on two CPUs of a two-CPU host sits halfway. Threads of a rank that
run elsewhere (gloo's, a DataLoader's workers) are spread over its main thread's CPUs, so the split is rough;
model/locality.py asks for a wide gap before it names a rank by it.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from fleetscope.streams.model.roles import finite
from fleetscope.streams.windows import Window

CPU_STATES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
IDLE_STATES = ("idle", "iowait")
RANK_CPU = "proc_cpu_cores"   # each rank's processes' CPU, cores (proc_features)


def cpu_number(label: str) -> int | None:
    """cpu3 or CPU3 -> 3."""
    digits = label[3:]
    return int(digits) if label[:3].lower() == "cpu" and digits.isdigit() else None


def rank_cpus(w: Window) -> set[int]:
    """The CPUs the rank's processes were seen on in this window (empty without the /proc sampler)."""
    if "proc" not in w.sources:
        return set()
    return {cpu for a in w.devices("proc", "proc.last_cpu") if (cpu := cpu_number(a.device)) is not None}


def node_busy_per_cpu(w: Window) -> dict[int, float]:
    """Per CPU, the busy share of its time in the node's window (/proc/stat's per-CPU rows: all but idle and
    iowait); empty without them."""
    if "host" not in w.sources:
        return {}
    busy_idle: dict[int, list[float]] = {}
    for state in CPU_STATES:
        for a in w.devices("host", f"cpu.{state}"):
            cpu = cpu_number(a.device)
            if cpu is not None and a.interval_ns > 0:
                busy_idle.setdefault(cpu, [0.0, 0.0])[1 if state in IDLE_STATES else 0] += a.delta_sum
    return {cpu: b / (b + i) for cpu, (b, i) in busy_idle.items() if b + i > 0}


def outside_rank_cpu_fracs(busy: Mapping[int, float], cpus: Sequence[set[int]],
                           vectors: Sequence[Mapping[str, float]]) -> list[float | None]:
    """Per rank of one host's step (`cpus[i]` its CPUs, `vectors[i]` its vector), the share of its CPUs' time
    that went to work outside the job; None for a rank whose CPUs are unknown, and for every rank when one of
    them has no own CPU (the job's share of a CPU is then unknown) or no CPU's busy share is known."""
    if not busy or any(not finite(v.get(RANK_CPU)) for v, c in zip(vectors, cpus) if c):
        return [None] * len(cpus)
    job: dict[int, float] = {}
    for own, where in zip(vectors, cpus):
        for cpu in where:
            job[cpu] = job.get(cpu, 0.0) + float(own[RANK_CPU]) / len(where)
    outside = {cpu: max(0.0, share - job.get(cpu, 0.0)) for cpu, share in busy.items()}
    out: list[float | None] = []
    for where in cpus:
        known = [outside[cpu] for cpu in where if cpu in outside]
        out.append(sum(known) / len(known) if known else None)
    return out
