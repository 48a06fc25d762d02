"""Host features of one window, from the host sampler's metrics.

A feature whose inputs are absent from the window is left out (masked), so a
missing source never reads as a zero. Counters arrive as per-tick deltas; a
window's rate is the deltas' sum over the time those deltas cover.
"""
from __future__ import annotations

from fleetscope.streams.cpu_features import CPU_STATES, node_busy_per_cpu
from fleetscope.streams.windows import MetricAgg, Window


def _delta(w: Window, metric: str, device: str = "all") -> MetricAgg | None:
    agg = w.agg("host", metric, device)
    return agg if agg is not None and agg.interval_ns > 0 else None


def _gauge(w: Window, metric: str, device: str = "all") -> float | None:
    agg = w.agg("host", metric, device)
    return agg.gauge_last if agg is not None and agg.gauge_n else None


def _rate(w: Window, metric: str, device: str = "all") -> float | None:
    agg = _delta(w, metric, device)
    return agg.delta_sum / (agg.interval_ns / 1e9) if agg else None


def _cpu(w: Window, out: dict) -> None:
    secs = {s: _delta(w, f"cpu.{s}") for s in CPU_STATES}
    if any(v is None for v in secs.values()):
        return
    total = sum(a.delta_sum for a in secs.values())
    if total <= 0:
        return
    idle = secs["idle"].delta_sum + secs["iowait"].delta_sum
    out["cpu_busy_frac"] = 1.0 - idle / total
    # CPU seconds per second: the cores kept busy, which model/outside_load.py sets against the ranks' own
    out["cpu_busy_cores"] = (total - idle) / (secs["idle"].interval_ns / 1e9)
    for state in ("user", "system", "iowait", "steal", "irq", "softirq"):
        out[f"cpu_{state}_frac"] = secs[state].delta_sum / total
    fracs = node_busy_per_cpu(w).values()
    if fracs:
        out["cpu_busy_max_core_frac"] = max(fracs)


def _memory(w: Window, out: dict) -> None:
    total, avail = _gauge(w, "mem.total"), _gauge(w, "mem.available")
    if total and avail is not None:
        out["mem_used_frac"] = 1.0 - avail / total
    anon, anon_huge = _gauge(w, "mem.anon"), _gauge(w, "mem.anon_huge")
    if anon and anon_huge is not None:
        out["thp_coverage_frac"] = anon_huge / anon
    hp_total, hp_free = _gauge(w, "mem.hugepages_total"), _gauge(w, "mem.hugepages_free")
    if hp_total and hp_free is not None:
        out["hugepages_used_frac"] = (hp_total - hp_free) / hp_total
    hit, miss = _delta(w, "vm.numa_hit"), _delta(w, "vm.numa_miss")
    if hit and miss and hit.delta_sum + miss.delta_sum > 0:
        out["numa_miss_ratio"] = miss.delta_sum / (hit.delta_sum + miss.delta_sum)
    for metric, name in (("vm.pgfault", "page_faults_per_s"), ("vm.pgmajfault", "major_faults_per_s")):
        rate = _rate(w, metric)
        if rate is not None:
            out[name] = rate


def _io(w: Window, out: dict) -> None:
    for metric, name in (("irq.cpu_total", "irq_per_s"), ("net.rx_bytes", "net_rx_bytes_per_s"),
                         ("net.tx_bytes", "net_tx_bytes_per_s"), ("disk.read_bytes", "disk_read_bytes_per_s"),
                         ("disk.write_bytes", "disk_write_bytes_per_s")):
        rate = w.summed_rate("host", metric, skip=("lo",))
        if rate is not None:
            out[name] = rate
    rate = _rate(w, "cpu.context_switches")
    if rate is not None:
        out["context_switches_per_s"] = rate


def _agent(w: Window, out: dict) -> None:
    for stat in ("dropped_events", "delivery_errors", "spooled"):
        agg = w.agg("agent", f"agent.{stat}", "all")
        if agg is not None and agg.gauge_n:
            out[f"agent_{stat}"] = agg.gauge_last


def host_features(window: Window) -> dict[str, float]:
    out: dict[str, float] = {}
    if "host" in window.sources:
        _cpu(window, out)
        _memory(window, out)
        _io(window, out)
    if "agent" in window.sources:
        _agent(window, out)
    return out
