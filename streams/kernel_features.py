"""Kernel features of one window, from the tracepoint tracer's aggregates.

Off-CPU time is summed over a rank's traced processes and divided by the time
the deltas cover, so a multi-threaded process can exceed 1: it reads as
"threads waiting, on average".
"""
from __future__ import annotations

from fleetscope.streams.windows import Window


def _rate(w: Window, metric: str) -> float | None:
    aggs = [a for a in w.devices("kernel", metric) if a.interval_ns > 0]
    if not aggs:
        return None
    # every device of one metric covers the same ticks; average their spans
    span_s = sum(a.interval_ns for a in aggs) / len(aggs) / 1e9
    return sum(a.delta_sum for a in aggs) / span_s


def kernel_features(w: Window) -> dict[str, float]:
    if "kernel" not in w.sources:
        return {}
    out: dict[str, float] = {}
    for metric, name, scale in (("kernel.offcpu_ns", "offcpu_threads", 1e-9),
                                ("kernel.runq_wait_ns", "runq_wait_threads", 1e-9),
                                ("kernel.ctx_switches", "ctx_switches_per_s", 1.0),
                                ("kernel.tcp_retransmits", "tcp_retransmits_per_s", 1.0),
                                ("kernel.irq_count", "irq_traced_per_s", 1.0)):
        rate = _rate(w, metric)
        if rate is not None:
            out[name] = rate * scale
    share = irq_max_cpu_share(w)
    if share is not None:
        out["irq_max_cpu_share"] = share
    return out


def irq_max_cpu_share(w: Window) -> float | None:
    """The busiest CPU's share of the hard IRQs the kernel tracer counted per CPU (devices cpu<N>, on
    the node's window): near 1 when one CPU takes the node's interrupts, 1/ncpu when they are spread.
    This is the node's; the share on a rank's own CPUs is irq_rank_cpu_share (streams/irq_features.py)."""
    counts = [a.delta_sum for a in w.devices("kernel", "kernel.irq_count")
              if a.interval_ns > 0 and a.device.startswith("cpu")]
    total = sum(counts)
    return max(counts) / total if len(counts) > 1 and total > 0 else None
