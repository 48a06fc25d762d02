"""Kernel features of one window, from the tracepoint tracer's aggregates.

Off-CPU time is summed over a rank's traced processes and divided by the time
the deltas cover, so a multi-threaded process can exceed 1: it reads as
"threads waiting, on average".
"""
from __future__ import annotations

from fleetscope.streams.irq_features import irq_max_cpu_share, node_irqs_per_cpu
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
    share = irq_max_cpu_share(node_irqs_per_cpu(w))   # the quiet CPUs count: the host rows name them
    if share is not None:
        out["irq_max_cpu_share"] = share
    return out
