"""Where a node's device interrupts land, and how many of them land on a rank's CPUs.

A NIC (or NVMe) queue's interrupts are steered to a few CPUs. When those are
the CPUs a rank runs on, its threads are preempted by the hard and soft IRQ
work and feed the GPU late (kb/irq_locality_miss.yaml).

- The node's interrupts per CPU, from its window: the kernel tracer's hard
  IRQ counts (``kernel.irq_count``, device ``cpu<N>``) when it runs, else the
  host interrupts collector's per-cell deltas (``irq.count``, device
  ``<irq>@CPU<N>``) of numbered IRQs only: those are devices' interrupts; the
  named rows (LOC timer ticks, RES, CAL, TLB) are the kernel's own per-CPU
  housekeeping, and timer ticks follow whichever CPUs are busy, so counting
  them would make any busy rank look as if it took the IRQs.
- The rank's CPUs: the CPUs the /proc sampler saw its processes last run on
  during the window (``proc.last_cpu``, device ``cpu<N>``; the main thread's,
  sampled at most every second: a rank pinned to CPUs is seen exactly, an
  unpinned one approximately).
- ``irq_rank_cpu_share``: the rank's CPUs' share of the node's interrupts in
  the window; ``irq_max_cpu_share``: the busiest CPU's share (the kernel
  tracer's feature, given from the host rows when it does not run).
"""
from __future__ import annotations

from fleetscope.streams.windows import Window


def _cpu_number(label: str) -> int | None:
    """cpu3 or CPU3 -> 3."""
    digits = label[3:]
    return int(digits) if label[:3].lower() == "cpu" and digits.isdigit() else None


def node_irqs_per_cpu(w: Window) -> dict[int, float]:
    """Device interrupts per CPU in the node's window; every CPU the source lists, quiet ones at 0."""
    out: dict[int, float] = {}
    if "kernel" in w.sources:
        for a in w.devices("kernel", "kernel.irq_count"):
            cpu = _cpu_number(a.device)
            if cpu is not None and a.interval_ns > 0:
                out[cpu] = out.get(cpu, 0.0) + a.delta_sum
        if out:
            return out
    if "host" not in w.sources:
        return out
    for a in w.devices("host", "irq.cpu_total"):   # names every online CPU, a quiet one too
        cpu = _cpu_number(a.device)
        if cpu is not None and a.interval_ns > 0:
            out.setdefault(cpu, 0.0)
    for a in w.devices("host", "irq.count"):
        irq, _, where = a.device.partition("@")
        cpu = _cpu_number(where)
        if irq.isdigit() and cpu is not None and a.interval_ns > 0:
            out[cpu] = out.get(cpu, 0.0) + a.delta_sum
    return out


def rank_cpus(w: Window) -> set[int]:
    """The CPUs the rank's processes were seen on in this window (empty without the /proc sampler)."""
    if "proc" not in w.sources:
        return set()
    return {cpu for a in w.devices("proc", "proc.last_cpu") if (cpu := _cpu_number(a.device)) is not None}


def irq_rank_cpu_share(irqs: dict[int, float], cpus: set[int]) -> float | None:
    total = sum(irqs.values())
    if not cpus or total <= 0:
        return None
    return sum(irqs.get(cpu, 0.0) for cpu in cpus) / total


def irq_max_cpu_share(irqs: dict[int, float]) -> float | None:
    total = sum(irqs.values())
    return max(irqs.values()) / total if len(irqs) > 1 and total > 0 else None
