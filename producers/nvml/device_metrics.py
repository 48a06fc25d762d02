"""Per-device NVML readings: which calls the sampler makes, how often, and how each is decoded.

Cadence, per metric group (the sampler's tick and its `gpm_interval_ns`,
`slow_interval_ns`, `static_interval_ns` and `pcie_min_interval_ns`; a group is due when at least 95% of its interval has
passed since it was last read, so a 1 s group on a 100 ms tick is read every
10th tick and not every 11th because of jitter):

  every tick      utilization, memory used, SM and memory clocks, throttle
                  reasons, and one nvmlDeviceGetFieldValues call for power,
                  energy, the PCIe replay counter and the NVLink counters
  gpm   (1 s)     GPM metrics: averages over the time since the previous GPM
                  read, so a slower read loses no activity, only resolution
                  finer than the stream's 1 s windows; OFU pairs the tensor
                  activity with the mean of the SM clocks read in that interval
  slow  (1 s)     temperature; the compute-process list, per-process
                  utilization and the per-process energy split (see sampler.py);
                  PCIe throughput, at `pcie_min_interval_ns` (also 1 s): each
                  nvmlDeviceGetPcieThroughput blocks ~20 ms inside the driver
  static (10 s)   memory total, max clocks, and one field-values call for ECC
                  counts and remapped rows (cumulative gauges that move rarely;
                  the aggregate ECC counts come from the InfoROM)

Gauges are the value at the read; a group read less often simply has fewer
rows. Counters (energy, PCIe replay, NVLink) are read every tick and become
deltas over exactly the time since their previous read. The max SM clock is
kept between its reads for OFU (it is a property of the board).
"""
from __future__ import annotations

import functools

import pynvml

from fleetscope.producers.nvml.field_batch import FieldSpec

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
THROTTLE_METRICS = ("nvml.throttle_reasons",) + tuple(f"nvml.throttle.{name}" for name, _ in THROTTLE_FLAGS)
_THROTTLE_BITS = tuple(bit for _, bit in THROTTLE_FLAGS)


@functools.lru_cache(maxsize=64)
def decode_throttle(mask: int) -> tuple[float, ...]:
    """Values for THROTTLE_METRICS: the raw mask, then one 0/1 per flag.

    Cached: a GPU sits in one or two masks for long stretches, and this runs
    for every GPU on every tick."""
    return (float(mask),) + tuple(1.0 if mask & bit else 0.0 for bit in _THROTTLE_BITS)


ALL_LINKS = 0xFFFFFFFF


def _ecc(err: int, counter: int):
    return lambda calls: pynvml.nvmlDeviceGetTotalEccErrors(calls.handle, err, counter)


def _remapped(k: int):
    return lambda calls: pynvml.nvmlDeviceGetRemappedRows(calls.handle)[k]


# Read every tick in one field-values call. Power is the instantaneous draw
# (mW); the classic nvmlDeviceGetPowerUsage is its fallback.
TICK_FIELDS = (
    FieldSpec("power", "nvml.power_w", pynvml.NVML_FI_DEV_POWER_INSTANT, scale=1e-3,
              fallback=lambda c: c.uint("nvmlDeviceGetPowerUsage")),
    FieldSpec("energy", "nvml.energy_j", pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, scale=1e-3, counter=True,
              fallback=lambda c: c.ull("nvmlDeviceGetTotalEnergyConsumption")),
    FieldSpec("pcie_replay", "nvml.pcie_replay", pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER, counter=True,
              fallback=lambda c: c.uint("nvmlDeviceGetPcieReplayCounter")),
    # NVLink: KiB of data (without protocol overhead) summed over links, and
    # the error totals over all lanes; all counters, published as deltas.
    FieldSpec("nvlink.tx_kib", "nvml.nvlink.tx_kib", pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS,
              counter=True),
    FieldSpec("nvlink.rx_kib", "nvml.nvlink.rx_kib", pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS,
              counter=True),
    FieldSpec("nvlink.crc_flit_errors", "nvml.nvlink.crc_flit_errors",
              pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL, counter=True),
    FieldSpec("nvlink.crc_data_errors", "nvml.nvlink.crc_data_errors",
              pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL, counter=True),
    FieldSpec("nvlink.replay_errors", "nvml.nvlink.replay_errors",
              pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL, counter=True),
    FieldSpec("nvlink.recovery_errors", "nvml.nvlink.recovery_errors",
              pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL, counter=True),
)

_CORR, _UNC = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
_VOL, _AGG = pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC

# Read every static interval in one field-values call: cumulative counts,
# published as gauges (a consumer diffs them if it wants rates).
STATIC_FIELDS = (
    FieldSpec("ecc.corrected_volatile", "nvml.ecc.corrected_volatile", pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL,
              fallback=_ecc(_CORR, _VOL)),
    FieldSpec("ecc.uncorrected_volatile", "nvml.ecc.uncorrected_volatile", pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL,
              fallback=_ecc(_UNC, _VOL)),
    FieldSpec("ecc.corrected_aggregate", "nvml.ecc.corrected_aggregate", pynvml.NVML_FI_DEV_ECC_SBE_AGG_TOTAL,
              fallback=_ecc(_CORR, _AGG)),
    FieldSpec("ecc.uncorrected_aggregate", "nvml.ecc.uncorrected_aggregate", pynvml.NVML_FI_DEV_ECC_DBE_AGG_TOTAL,
              fallback=_ecc(_UNC, _AGG)),
    FieldSpec("remapped_rows.correctable", "nvml.remapped_rows.correctable", pynvml.NVML_FI_DEV_REMAPPED_COR,
              fallback=_remapped(0)),
    FieldSpec("remapped_rows.uncorrectable", "nvml.remapped_rows.uncorrectable", pynvml.NVML_FI_DEV_REMAPPED_UNC,
              fallback=_remapped(1)),
    FieldSpec("remapped_rows.pending", "nvml.remapped_rows.pending", pynvml.NVML_FI_DEV_REMAPPED_PENDING,
              fallback=_remapped(2)),
    FieldSpec("remapped_rows.failure", "nvml.remapped_rows.failure", pynvml.NVML_FI_DEV_REMAPPED_FAILURE,
              fallback=_remapped(3)),
)
