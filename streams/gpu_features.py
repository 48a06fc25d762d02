"""GPU features of one window, from the NVML sampler's metrics.

A rank's window gets its processes' share of GPU energy (joules per window per
rank, split by SM utilization in the agent), their SM utilization and memory.
A node's window gets the devices' energy, power, utilization, OFU, whether
any clock-limiting throttle reason was active, the hottest GPU's temperature,
the mean SM clock, and the loud hardware faults: Xid events (count, the last
code and the GPU that raised it), double-bit ECC events, uncorrected ECC
errors and rows waiting for (or failing) remapping. `gpu_device_features`
gives the same per GPU, so the scorer can join each rank's own GPU into its
vector. Absent inputs leave the feature out (masked).
"""
from __future__ import annotations

from fleetscope.schema import NODE_TENANT
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
    if w.key[0] == NODE_TENANT:
        out.update(node_gpu_health(w))
    return out


# per GPU, what describes the device a rank runs on (joined into the rank's vector by the scorer)
# (OFU and tensor activity too: a rank's own GPU's, so OFU is tied to the rank whose process runs there)
DEVICE_GAUGES = (("nvml.temp_c", "gpu_temp_c"), ("nvml.sm_clock_mhz", "gpu_sm_clock_mhz"),
                 ("nvml.power_w", "gpu_power_w"), ("nvml.ofu", "gpu_ofu"), ("nvml.gpu_util", "gpu_util"),
                 ("nvml.gpm.tensor_util", "gpu_tensor_util"))
# event rows (interval 0, one row per event): counted per window
EVENTS = (("nvml.xid", "gpu_xid_count"), ("nvml.event.dbe_ecc", "gpu_ecc_dbe_count"))
# cumulative counts since boot (gauges): any non-zero value is a fault to report
ECC_GAUGES = (("nvml.ecc.uncorrected_volatile", "gpu_ecc_uncorrected"),
              ("nvml.remapped_rows.pending", "gpu_row_remap_pending"),
              ("nvml.remapped_rows.failure", "gpu_row_remap_pending"))
FAULT_FEATURES = ("gpu_xid_count", "gpu_xid_last_code", "gpu_xid_gpu", "gpu_ecc_dbe_count", "gpu_ecc_uncorrected",
                  "gpu_row_remap_pending")


def gpu_index(label: str) -> float | None:
    """"gpu3" -> 3.0 (the samplers' device label); None for anything else."""
    return float(label[3:]) if label.startswith("gpu") and label[3:].isdigit() else None


def gpu_device_features(w: Window) -> dict[str, dict[str, float]]:
    """{device label: features of that GPU} for a node window."""
    if "nvml" not in w.sources:
        return {}
    out: dict[str, dict[str, float]] = {}
    for metric, name in DEVICE_GAUGES:
        for a in w.devices("nvml", metric):
            if a.gauge_n:
                out.setdefault(a.device, {})[name] = a.gauge_sum / a.gauge_n
    for reason in LIMITING:
        for a in w.devices("nvml", f"nvml.throttle.{reason}"):
            if a.gauge_n:
                d = out.setdefault(a.device, {})
                d["gpu_throttled"] = max(d.get("gpu_throttled", 0.0), float(a.gauge_last > 0))
    for metric, name in EVENTS:
        for a in w.devices("nvml", metric):
            d = out.setdefault(a.device, {})
            d[name] = d.get(name, 0.0) + a.gauge_n
            if metric == "nvml.xid":
                d["gpu_xid_last_code"] = a.gauge_last
                index = gpu_index(a.device)
                if index is not None:
                    d["gpu_xid_gpu"] = index
    for metric, name in ECC_GAUGES:
        for a in w.devices("nvml", metric):
            if a.gauge_n:
                d = out.setdefault(a.device, {})
                d[name] = d.get(name, 0.0) + a.gauge_last
    return out


def node_gpu_health(w: Window) -> dict[str, float]:
    """The node's hottest GPU, mean SM clock and every GPU's loud faults (a node window's features)."""
    devices = gpu_device_features(w)
    out: dict[str, float] = {}
    temps = [d["gpu_temp_c"] for d in devices.values() if "gpu_temp_c" in d]
    if temps:
        out["gpu_temp_c"] = max(temps)
    clocks = [d["gpu_sm_clock_mhz"] for d in devices.values() if "gpu_sm_clock_mhz" in d]
    if clocks:
        out["gpu_sm_clock_mhz"] = sum(clocks) / len(clocks)
    for name in ("gpu_xid_count", "gpu_ecc_dbe_count", "gpu_ecc_uncorrected", "gpu_row_remap_pending"):
        values = [d[name] for d in devices.values() if name in d]
        if values:
            out[name] = sum(values)
    xid = [d for d in devices.values() if "gpu_xid_last_code" in d]
    if xid:
        out["gpu_xid_last_code"] = xid[-1]["gpu_xid_last_code"]
        if "gpu_xid_gpu" in xid[-1]:
            out["gpu_xid_gpu"] = xid[-1]["gpu_xid_gpu"]
    return out
