"""Per-device NVML readings: which calls the sampler makes, and how each is decoded.

A reader takes a device handle and returns Readings. A Reading with a
`counter_scale` is a monotonically rising counter: the sampler turns it into
a delta over the interval since the previous sample (times the scale), and
emits nothing for the first sample or after a counter reset.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import pynvml


class Reading(NamedTuple):
    metric: str
    value: float
    counter_scale: float | None = None  # None: a gauge


# The clock-event ("throttle") reason bits, as pynvml names them; one 0/1 gauge each.
THROTTLE_FLAGS = (
    ("gpu_idle", pynvml.nvmlClocksEventReasonGpuIdle),
    ("applications_clocks_setting", pynvml.nvmlClocksEventReasonApplicationsClocksSetting),
    ("sw_power_cap", pynvml.nvmlClocksEventReasonSwPowerCap),
    ("hw_slowdown", pynvml.nvmlClocksEventReasonHwSlowdown),
    ("sync_boost", pynvml.nvmlClocksEventReasonSyncBoost),
    ("sw_thermal_slowdown", pynvml.nvmlClocksEventReasonSwThermalSlowdown),
    ("hw_thermal_slowdown", pynvml.nvmlClocksEventReasonHwThermalSlowdown),
    ("hw_power_brake_slowdown", pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown),
    ("display_clock_setting", pynvml.nvmlClocksEventReasonDisplayClockSetting),
)


def decode_throttle(mask: int) -> list[Reading]:
    return [Reading("nvml.throttle_reasons", float(mask))] + [
        Reading(f"nvml.throttle.{name}", 1.0 if mask & bit else 0.0) for name, bit in THROTTLE_FLAGS]


def _utilization(h) -> list[Reading]:
    u = pynvml.nvmlDeviceGetUtilizationRates(h)
    return [Reading("nvml.gpu_util", u.gpu), Reading("nvml.mem_util", u.memory)]


def _memory(h) -> list[Reading]:
    m = pynvml.nvmlDeviceGetMemoryInfo(h)
    return [Reading("nvml.mem_used", m.used), Reading("nvml.mem_total", m.total)]


def _throttle(h) -> list[Reading]:
    try:
        mask = pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)
    except pynvml.NVMLError_FunctionNotFound:
        # Drivers before the rename only export the older, deprecated name.
        mask = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)
    return decode_throttle(mask)


def _ecc(h) -> list[Reading]:
    out = []
    for err_name, err in (("corrected", pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                          ("uncorrected", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)):
        for cnt_name, cnt in (("volatile", pynvml.NVML_VOLATILE_ECC), ("aggregate", pynvml.NVML_AGGREGATE_ECC)):
            out.append(Reading(f"nvml.ecc.{err_name}_{cnt_name}",
                               pynvml.nvmlDeviceGetTotalEccErrors(h, err, cnt)))
    return out


def _remapped_rows(h) -> list[Reading]:
    corr, unc, pending, failure = pynvml.nvmlDeviceGetRemappedRows(h)
    return [Reading("nvml.remapped_rows.correctable", corr), Reading("nvml.remapped_rows.uncorrectable", unc),
            Reading("nvml.remapped_rows.pending", pending), Reading("nvml.remapped_rows.failure", failure)]


def _clock(kind: int, metric: str, maximum: bool) -> Callable:
    get = pynvml.nvmlDeviceGetMaxClockInfo if maximum else pynvml.nvmlDeviceGetClockInfo
    return lambda h: [Reading(metric, get(h, kind))]


def _pcie(counter: int, metric: str) -> Callable:
    return lambda h: [Reading(metric, pynvml.nvmlDeviceGetPcieThroughput(h, counter))]


# (field name, reader). The name keys unsupported/error bookkeeping and status
# events. Utilization comes first: it is the cheapest call, and the first to
# report a GPU that has fallen off the bus.
DEVICE_FIELDS: tuple[tuple[str, Callable], ...] = (
    ("utilization", _utilization),
    ("memory", _memory),
    ("power", lambda h: [Reading("nvml.power_w", pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0)]),
    ("energy", lambda h: [Reading("nvml.energy_j", pynvml.nvmlDeviceGetTotalEnergyConsumption(h), 1e-3)]),
    ("temperature", lambda h: [Reading("nvml.temp_c",
                                       pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU))]),
    ("sm_clock", _clock(pynvml.NVML_CLOCK_SM, "nvml.sm_clock_mhz", False)),
    ("sm_clock_max", _clock(pynvml.NVML_CLOCK_SM, "nvml.sm_clock_max_mhz", True)),
    ("mem_clock", _clock(pynvml.NVML_CLOCK_MEM, "nvml.mem_clock_mhz", False)),
    ("mem_clock_max", _clock(pynvml.NVML_CLOCK_MEM, "nvml.mem_clock_max_mhz", True)),
    ("throttle", _throttle),
    ("pcie_tx", _pcie(pynvml.NVML_PCIE_UTIL_TX_BYTES, "nvml.pcie_tx_kbps")),
    ("pcie_rx", _pcie(pynvml.NVML_PCIE_UTIL_RX_BYTES, "nvml.pcie_rx_kbps")),
    ("pcie_replay", lambda h: [Reading("nvml.pcie_replay", pynvml.nvmlDeviceGetPcieReplayCounter(h), 1.0)]),
    ("ecc", _ecc),
    ("remapped_rows", _remapped_rows),
)

# nvmlDeviceGetPcieThroughput measures over ~20 ms inside the driver, so each
# call blocks that long; the sampler reads these at most once per
# `pcie_min_interval_ns` rather than on every tick.
SLOW_FIELDS = frozenset({"pcie_tx", "pcie_rx"})


class NvlinkField(NamedTuple):
    name: str        # also the field name for bookkeeping: "nvlink.<name>"
    field_id: int
    scope_id: int    # the link; ALL_LINKS asks for the sum over links
    metric: str


ALL_LINKS = 0xFFFFFFFF
# All are counters, published as deltas. Throughput is KiB of data (without
# protocol overhead); the error counters are the totals over all lanes.
NVLINK_FIELDS = (
    NvlinkField("tx_kib", pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS, "nvml.nvlink.tx_kib"),
    NvlinkField("rx_kib", pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS, "nvml.nvlink.rx_kib"),
    NvlinkField("crc_flit_errors", pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL, 0,
                "nvml.nvlink.crc_flit_errors"),
    NvlinkField("crc_data_errors", pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL, 0,
                "nvml.nvlink.crc_data_errors"),
    NvlinkField("replay_errors", pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL, 0, "nvml.nvlink.replay_errors"),
    NvlinkField("recovery_errors", pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL, 0,
                "nvml.nvlink.recovery_errors"),
)

_VALUE_MEMBER = {pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal", pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
                 pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal", pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
                 pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal", pynvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
                 pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal"}


def read_nvlink(h, fields: list[NvlinkField]) -> tuple[list[Reading], list[tuple[NvlinkField, int]]]:
    """One nvmlDeviceGetFieldValues call for all `fields`: the readings that
    answered, and (field, nvmlReturn) for each that did not."""
    values = pynvml.nvmlDeviceGetFieldValues(h, [(f.field_id, f.scope_id) for f in fields])
    readings, failed = [], []
    for f, v in zip(fields, values):
        member = _VALUE_MEMBER.get(v.valueType)
        if v.nvmlReturn != pynvml.NVML_SUCCESS or member is None:
            failed.append((f, v.nvmlReturn if v.nvmlReturn != pynvml.NVML_SUCCESS else pynvml.NVML_ERROR_UNKNOWN))
        else:
            readings.append(Reading(f.metric, float(getattr(v.value, member)), 1.0))
    return readings, failed
