"""GPU features of one window, from the NVML sampler's metrics.

A rank's window gets its processes' share of GPU energy (joules per window per
rank, split by SM utilization in the agent), their SM utilization and memory.
A node's window gets the devices' energy, power, utilization, OFU and whether
any clock-limiting throttle reason was active. Absent inputs leave the feature
out (masked).
"""
from __future__ import annotations

from fleetscope.streams.windows import Window

# Throttle reasons that mean the GPU ran slower than it could (idle and app-clock settings do not).
LIMITING = ("sw_power_cap", "hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown")


def _sum_deltas(w: Window, metric: str) -> float | None:
    aggs = [a for a in w.devices("nvml", metric) if a.interval_ns > 0]
    return sum(a.delta_sum for a in aggs) if aggs else None


def _gauge_means(w: Window, metric: str) -> list[float]:
    return [a.gauge_sum / a.gauge_n for a in w.devices("nvml", metric) if a.gauge_n]


def gpu_features(w: Window) -> dict[str, float]:
    if "nvml" not in w.sources:
        return {}
    out: dict[str, float] = {}
    rank_energy = _sum_deltas(w, "nvml.proc_energy_j")
    if rank_energy is not None:
        out["gpu_energy_j"] = rank_energy
    device_energy = _sum_deltas(w, "nvml.energy_j")
    if device_energy is not None:
        out["gpu_energy_j"] = device_energy
    for metric, name in (("nvml.proc_sm_util", "gpu_proc_sm_util"), ("nvml.gpu_util", "gpu_util"),
                         ("nvml.power_w", "gpu_power_w"), ("nvml.ofu", "gpu_ofu"),
                         ("nvml.gpm.tensor_util", "gpu_tensor_util")):
        means = _gauge_means(w, metric)
        if means:
            out[name] = sum(means) / len(means)
    mem = [a.gauge_last for a in w.devices("nvml", "nvml.proc_mem_used") if a.gauge_n]
    if mem:
        out["gpu_proc_mem_bytes"] = sum(mem)
    flags = [a.gauge_last for reason in LIMITING for a in w.devices("nvml", f"nvml.throttle.{reason}") if a.gauge_n]
    if flags:
        out["gpu_throttled"] = float(max(flags) > 0)
    return out
