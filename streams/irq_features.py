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
  the window; ``irq_max_cpu_share``: the busiest CPU's share. The CPUs that
  took none count too (the host rows list every online CPU): the kernel
  tracer reports only CPUs that took interrupts, so a node whose interrupts
  all land on one CPU, the worst case, read as "no share" (this VM steers
  every device interrupt to cpu1).
- ``irq_time_rank_cpu_frac``: the share of the rank's CPUs' time spent in
  hard and soft interrupt work (/proc/stat's per-CPU irq and softirq time, the
  host rows ``cpu.irq`` and ``cpu.softirq``). Counts say where interrupts land;
  this says what they cost the rank: network receive work (NET_RX softirqs)
  runs on the CPU that took the NIC's interrupt, or another one steered by
  RPS, and a loopback flood raises no hardware interrupt at all (the dev
  scenario irq_storm: 13-17% of rank 1's CPU in softirq against 1% before,
  with 10-30 device interrupts a second throughout).
"""
from __future__ import annotations

from fleetscope.streams.cpu_features import cpu_number
from fleetscope.streams.windows import Window


def node_irqs_per_cpu(w: Window) -> dict[int, float]:
    """Device interrupts per CPU in the node's window; every CPU the sources list, quiet ones at 0."""
    out: dict[int, float] = {}
    if "kernel" in w.sources:
        for a in w.devices("kernel", "kernel.irq_count"):
            cpu = cpu_number(a.device)
            if cpu is not None and a.interval_ns > 0:
                out[cpu] = out.get(cpu, 0.0) + a.delta_sum
    if "host" not in w.sources:
        return out
    for a in w.devices("host", "irq.cpu_total"):   # names every online CPU, a quiet one too
        cpu = cpu_number(a.device)
        if cpu is not None and a.interval_ns > 0:
            out.setdefault(cpu, 0.0)
    if any(out.values()):   # the kernel tracer counted them: the host rows only added the quiet CPUs
        return out
    for a in w.devices("host", "irq.count"):
        irq, _, where = a.device.partition("@")
        cpu = cpu_number(where)
        if irq.isdigit() and cpu is not None and a.interval_ns > 0:
            out[cpu] = out.get(cpu, 0.0) + a.delta_sum
    return out


def irq_rank_cpu_share(irqs: dict[int, float], cpus: set[int]) -> float | None:
    total = sum(irqs.values())
    if not cpus or total <= 0:
        return None
    return sum(irqs.get(cpu, 0.0) for cpu in cpus) / total


def irq_max_cpu_share(irqs: dict[int, float]) -> float | None:
    total = sum(irqs.values())
    return max(irqs.values()) / total if len(irqs) > 1 and total > 0 else None


def node_irq_time_per_cpu(w: Window) -> dict[int, float]:
    """Per CPU, the share of its time in hard and soft interrupt work during the node's window."""
    if "host" not in w.sources:
        return {}
    spent: dict[int, float] = {}
    span: dict[int, float] = {}
    for metric in ("cpu.irq", "cpu.softirq"):
        for a in w.devices("host", metric):
            cpu = cpu_number(a.device)
            if cpu is not None and a.interval_ns > 0:
                spent[cpu] = spent.get(cpu, 0.0) + a.delta_sum
                span[cpu] = max(span.get(cpu, 0.0), a.interval_ns / 1e9)
    return {cpu: spent[cpu] / span[cpu] for cpu in spent}


def irq_time_rank_cpu_frac(irq_time: dict[int, float], cpus: set[int]) -> float | None:
    """The mean interrupt-time share of the rank's CPUs; None when none of them is known."""
    known = [irq_time[cpu] for cpu in cpus if cpu in irq_time]
    return sum(known) / len(known) if known else None

