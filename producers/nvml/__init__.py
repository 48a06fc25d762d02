"""GPU telemetry through NVML (nvidia-ml-py, import name `pynvml`).

NvmlSampler (sampler.py) builds one "nvml" batch per tick; XidWatcher
(xid_watcher.py) publishes critical events the moment they arrive.

Metrics, device "gpu<N>" unless noted. Gauges have interval_ns 0; deltas
carry the interval since the previous sample (none on the first sample or
after a counter reset). Not every metric is read every tick: utilization,
memory used, clocks, throttle reasons, power and every counter are; GPM
(with OFU), temperature, PCIe throughput and the per-process rows once a second; memory
total, max clocks, ECC and remapped rows every 10 s (device_metrics.py has
the cadence table; NvmlSampler's *_interval_ns arguments set it).

  per device (node identity, gpu = N)
    nvml.gpu_util, nvml.mem_util                  % (NVML utilization rates)
    nvml.mem_used, nvml.mem_total                 bytes
    nvml.power_w                                  W, instantaneous (field value; getter as fallback)
    nvml.energy_j                                 J, delta of the total-energy counter
    nvml.temp_c                                   deg C
    nvml.sm_clock_mhz, nvml.sm_clock_max_mhz      MHz
    nvml.mem_clock_mhz, nvml.mem_clock_max_mhz    MHz
    nvml.throttle_reasons                         the raw clock-event bitmask, as a float
    nvml.throttle.<flag>                          0/1: sw_power_cap, hw_slowdown, hw_thermal_slowdown,
                                                  hw_power_brake_slowdown, sw_thermal_slowdown, sync_boost,
                                                  gpu_idle, applications_clocks_setting, display_clock_setting
    nvml.pcie_tx_kbps, nvml.pcie_rx_kbps          KB/s (read at most once per pcie_min_interval_ns)
    nvml.pcie_replay                              delta of the PCIe replay counter
    nvml.nvlink.tx_kib, nvml.nvlink.rx_kib        KiB, deltas (field values, all links)
    nvml.nvlink.{crc_flit,crc_data,replay,recovery}_errors   deltas
    nvml.ecc.{corrected,uncorrected}_{volatile,aggregate}    counts (cumulative gauges)
    nvml.remapped_rows.{correctable,uncorrectable,pending,failure}
    nvml.gpm.sm_util, nvml.gpm.sm_occupancy, nvml.gpm.tensor_util,
    nvml.gpm.tensor_util.{hmma,imma,dmma,dfma}, nvml.gpm.fp{64,32,16}_util,
    nvml.gpm.dram_bw_util                         %, Hopper+ (GPM), averaged between ticks
    nvml.gpm.{pcie,nvlink}_{tx,rx}_mibps          MiB/s, GPM
    nvml.ofu                                      %, tensor activity x mean SM clock / max (see gpm.py)
  per process (the resolver's identity, pid, gpu = N)
    nvml.proc_mem_used                            bytes
    nvml.proc_sm_util, nvml.proc_mem_util         %, mean of NVML's samples since the previous read
    nvml.proc_energy_j                            J, the device energy since the previous split, shared by SM util
  status (node identity)
    nvml.status        device "library" | "init" | "no_gpu" | "events", value 0
    nvml.unsupported   device "gpu<N>:<field>", value 1 (fields: power, energy, pcie_replay,
                       nvlink.<name>, ecc.<kind>, remapped_rows.<kind>, temperature, ...)
    nvml.gpu_lost      device "gpu<N>", value 1
  events (XidWatcher)
    nvml.xid (value = Xid code), nvml.event.dbe_ecc, nvml.event.clock_change
"""
