"""Per-process features of one rank window, from the /proc sampler's rows (source "proc").

A rank's processes (its main process, data loader workers: everything that
inherited its RANK) are separate series (device pid<N>). Counters are summed
over them: each process's deltas divided by the time they cover, then summed
over the processes, so a worker that started mid-window counts at its own
rate. proc_cpu_cores reads as "CPU seconds per second" and can exceed 1. Gauges
(RSS, threads) are each process's newest value, summed. A metric the window
has no rows of is left out (masked), never 0.
"""
from __future__ import annotations

from fleetscope.streams.windows import Window

RATES = (("proc.cpu_ns", "proc_cpu_cores", 1e-9),
         ("proc.majflt", "proc_majflt_per_s", 1.0),
         ("proc.minflt", "proc_minflt_per_s", 1.0),
         ("proc.vol_ctx", "proc_vol_ctx_per_s", 1.0),
         ("proc.invol_ctx", "proc_invol_ctx_per_s", 1.0),
         ("proc.read_bytes", "proc_read_bytes_per_s", 1.0),
         ("proc.write_bytes", "proc_write_bytes_per_s", 1.0))
GAUGES = (("proc.rss_bytes", "proc_rss_bytes"), ("proc.threads", "proc_threads"))


def proc_features(w: Window) -> dict[str, float]:
    if "proc" not in w.sources:
        return {}
    out: dict[str, float] = {}
    for metric, name, scale in RATES:
        rate = w.summed_rate("proc", metric)
        if rate is not None:
            out[name] = rate * scale
    for metric, name in GAUGES:
        last = [a.gauge_last for a in w.devices("proc", metric) if a.gauge_n and a.gauge_last == a.gauge_last]
        if last:
            out[name] = sum(last)
    return out
