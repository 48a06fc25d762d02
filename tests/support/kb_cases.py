"""Per KB entry, feature vectors that must match it and near-misses that must not, shared by the KB, diagnosis
store and fingerprint-metric tests.

The anomalies are built the way the model reports them: a realistic healthy window with the fault's features
changed, peer z-scores of the faulty rank, and NLL contributions of z^2/2 for the deviating features (what a
diagonal Gaussian component gives for a standardized feature)."""
from __future__ import annotations

from fleetscope.streams.diagnosis.anomaly import Anomaly

HEALTHY = {
    "cpu_busy_frac": 0.45, "cpu_user_frac": 0.35, "cpu_system_frac": 0.05, "cpu_iowait_frac": 0.01,
    "cpu_steal_frac": 0.0, "cpu_irq_frac": 0.005, "cpu_softirq_frac": 0.01, "cpu_busy_max_core_frac": 0.9,
    "mem_used_frac": 0.5, "thp_coverage_frac": 0.8, "hugepages_used_frac": 0.0, "numa_miss_ratio": 0.01,
    "page_faults_per_s": 2000.0, "major_faults_per_s": 0.0, "irq_per_s": 20000.0, "net_rx_bytes_per_s": 1e8,
    "net_tx_bytes_per_s": 1e8, "disk_read_bytes_per_s": 1e6, "disk_write_bytes_per_s": 1e6,
    "context_switches_per_s": 30000.0, "agent_dropped_events": 0.0,
    "offcpu_threads": 2.0, "ctx_switches_per_s": 5000.0, "tcp_retransmits_per_s": 0.0, "irq_traced_per_s": 5000.0,
    "irq_max_cpu_share": 0.1, "tcp_tx_bytes_per_s": 1e8, "tcp_rx_bytes_per_s": 1e8,
    "gpu_util": 95.0, "gpu_proc_sm_util": 90.0, "gpu_power_w": 600.0, "gpu_ofu": 0.4, "gpu_tensor_util": 0.5,
    "gpu_energy_j": 600.0, "gpu_proc_mem_bytes": 60e9, "gpu_throttled": 0.0, "gpu_sm_clock_mhz": 1980.0,
    "gpu_xid_count": 0.0, "gpu_temp_c": 65.0,
    "cuda_launch_per_s": 20000.0, "cuda_sync_frac": 0.1, "cuda_memcpy_bytes_per_s": 2e9,
    "cuda_memcpy_htod_bytes_per_s": 1e9, "cuda_memcpy_lat_p50_ns": 20000.0, "cuda_memcpy_lat_p99_ns": 200000.0,
    "cuda_mem_live_bytes": 60e9, "cuda_malloc_free_balance_bytes": 0.0, "cuda_errors_per_s": 0.0,
    "cuda_memcpy_frac": 0.03,
    "nccl_calls_per_s": 200.0, "nccl_bytes_per_s": 5e10, "nccl_lat_p50_ns": 1e6, "nccl_lat_p99_ns": 5e6,
    "nccl_algbw_gbps": 150.0, "nccl_time_frac": 0.3, "nccl_allreduce_algbw_gbps": 150.0,
    "python_gc_frac": 0.005, "python_gc_per_s": 2.0, "python_calls_per_s": 1e5, "python_top_func_share": 0.1,
    "torch_ops_per_s": 5000.0, "torch_op_time_frac": 0.6, "torch_matmul_ops_per_s": 1000.0,
    "torch_elementwise_ops_per_s": 3000.0, "torch_other_ops_per_s": 1000.0,
}


def anomaly(features: dict | None = None, peer_z: dict | None = None, contributions: dict | None = None) -> Anomaly:
    peer_z = dict(peer_z or {})
    if contributions is None:
        contributions = {f: z * z / 2 for f, z in peer_z.items() if abs(z) >= 2}
    return Anomaly("acme", "train-1", "node-a", 3, 1_700_000_000_000_000_000, score=40.0, threshold=25.0,
                   detectors=["gmm", "peer"], contributions=contributions, peer_z=peer_z,
                   features={**HEALTHY, **(features or {})})


# entry -> (must match, must not match); each case is (features, peer_z[, contributions])
CASES: dict[str, tuple[list, list]] = {
    "gpu_power_thermal_throttling": (
        [({"gpu_throttled": 1, "gpu_temp_c": 88, "gpu_sm_clock_mhz": 1400},
          {"gpu_sm_clock_mhz": -6, "gpu_temp_c": 4, "nccl_time_frac": -3.2}),
         # the whole job runs hot: no peer deviation, the model's contributions only
         ({"gpu_throttled": 1, "gpu_temp_c": 90, "gpu_sm_clock_mhz": 1500}, {},
          {"gpu_temp_c": 8.0, "gpu_sm_clock_mhz": 6.0})],
        [({"gpu_temp_c": 90}, {"gpu_temp_c": 5}),                        # hot, but clocks not limited
         ({"gpu_throttled": 1, "gpu_temp_c": 70}, {"gpu_sm_clock_mhz": -0.5})],  # a flag blip, clocks normal
    ),
    "numa_misplacement": (
        [({"numa_miss_ratio": 0.4, "cuda_memcpy_lat_p99_ns": 900000}, {"numa_miss_ratio": 6, "cuda_memcpy_lat_p99_ns": 3})],
        [({"numa_miss_ratio": 0.04}, {"numa_miss_ratio": 5}),            # relative jump, tiny absolute
         ({"numa_miss_ratio": 0.15}, {"numa_miss_ratio": 0.3})],         # mild, host-wide, below 0.3
    ),
    "irq_locality_miss": (
        # the dev scenario irq_storm: receive work eating rank 1's CPU, wherever the device IRQs land
        [({"irq_max_cpu_share": 1.0, "irq_rank_cpu_share": 0.0, "irq_time_rank_cpu_frac": 0.15},
          {"runq_wait_threads": 7, "irq_time_rank_cpu_frac": 9}),
         ({"irq_max_cpu_share": 0.9, "irq_rank_cpu_share": 0.9, "irq_time_rank_cpu_frac": 0.08},  # a NIC's IRQs
          {"irq_rank_cpu_share": 6, "offcpu_threads": 1})],
        [({"irq_max_cpu_share": 0.2, "cpu_softirq_frac": 0.1}, {"offcpu_threads": 4}),   # IRQs spread out
         # concentrated and a rank preempted, but nothing says on this rank's CPUs (no last-CPU rows)
         ({"irq_max_cpu_share": 0.8, "cpu_softirq_frac": 0.12},
          {"offcpu_threads": 4, "proc_invol_ctx_per_s": 5, "irq_max_cpu_share": 3}),
         ({"irq_time_rank_cpu_frac": 0.1}, {"offcpu_threads": 0.5}),   # interrupt work, but the rank does not pay
         # all of the node's IRQs on this rank's CPU, costing it 1% of its time: a busy rank for another reason
         ({"irq_max_cpu_share": 1.0, "irq_rank_cpu_share": 1.0, "irq_time_rank_cpu_frac": 0.01},
          {"runq_wait_threads": 7})],
    ),
    "huge_page_coverage_loss": (
        [({"thp_coverage_frac": 0.1, "page_faults_per_s": 80000}, {"thp_coverage_frac": -7, "page_faults_per_s": 5})],
        [({"thp_coverage_frac": 0.5}, {"thp_coverage_frac": -4}),        # dropped, still above 0.3
         ({"thp_coverage_frac": 0.1}, {"thp_coverage_frac": 0.1})],      # no THP anywhere: nothing was lost
    ),
    "cpu_contention_noisy_neighbour": (
        [({"cpu_busy_frac": 0.97, "cpu_steal_frac": 0.15, "offcpu_threads": 9},
          {"offcpu_threads": 5, "ctx_switches_per_s": 4, "cpu_busy_frac": 3})],
        [({"cpu_busy_frac": 0.5, "cpu_steal_frac": 0.1}, {"cpu_steal_frac": 4}),
         ({"cpu_busy_frac": 0.95}, {"cpu_busy_frac": 0.2})],            # busy by itself, nobody waiting
    ),
    "straggler_rank": (
        [({"nccl_time_frac": 0.05}, {"nccl_time_frac": -6, "nccl_lat_p50_ns": -4, "cpu_busy_frac": 2.5}),
         ({"torch_comm_wait_frac": 0.04}, {"torch_comm_wait_frac": -9})],   # a CPU (gloo) job
        [({"nccl_time_frac": 0.25}, {"nccl_time_frac": -2}),            # within peer noise
         ({"nccl_time_frac": 0.6}, {"nccl_time_frac": 5}),             # waits more: a peer of the straggler
         ({"torch_comm_wait_frac": 0.95}, {"torch_comm_wait_frac": 4})],  # the same in a gloo job
    ),
    "slow_degraded_link": (
        [({"nccl_algbw_gbps": 40, "nccl_lat_p99_ns": 3e7, "nccl_time_frac": 0.55},
          {"nccl_algbw_gbps": -7, "nccl_lat_p99_ns": 6, "nccl_time_frac": 4}),
         # a ring: every rank's bandwidth fell alike (no peer z), the job slowed, this rank wakes more per
         # collective than its peers (its model saw the bandwidth fall against its own past)
         ({"nccl_algbw_gbps": 0.05, "link_wakeup_ratio": 1.35, "job_iteration_time_ratio": 1.9},
          {"nccl_algbw_gbps": -0.3}, {"nccl_algbw_gbps": 12.0, "nccl_lat_p99_ns": 4.0})],
        [({"nccl_algbw_gbps": 40}, {"nccl_algbw_gbps": -7, "nccl_lat_p99_ns": 1}),
         ({"nccl_lat_p99_ns": 2e7}, {"nccl_lat_p99_ns": 5, "nccl_algbw_gbps": -1}),
         # wakes more per collective, but the job is no slower: a rank that differs by design
         ({"link_wakeup_ratio": 1.35, "job_iteration_time_ratio": 1.0}, {}, {"nccl_algbw_gbps": 12.0})],
    ),
    "h2d_copy_stall_pageable": (
        [({"cuda_memcpy_frac": 0.4, "cuda_memcpy_htod_bytes_per_s": 5e8, "cuda_memcpy_lat_p50_ns": 2e6},
          {"cuda_memcpy_lat_p50_ns": 6, "cuda_memcpy_frac": 5})],
        [({"cuda_memcpy_frac": 0.4, "cuda_memcpy_htod_bytes_per_s": 1e7}, {"cuda_memcpy_frac": 5}),
         ({"cuda_memcpy_frac": 0.1, "cuda_memcpy_htod_bytes_per_s": 5e8}, {"cuda_memcpy_lat_p50_ns": 4})],
    ),
    "gpu_memory_leak": (
        [({"cuda_malloc_free_balance_bytes": 512 * 2**20, "cuda_mem_live_bytes": 75e9},
          {"cuda_mem_live_bytes": 4, "cuda_malloc_free_balance_bytes": 6})],
        [({"cuda_malloc_free_balance_bytes": 32 * 2**20}, {"cuda_malloc_free_balance_bytes": 5}),
         ({"cuda_malloc_free_balance_bytes": 256 * 2**20}, {"cuda_malloc_free_balance_bytes": 0.2})],  # all ranks warm up
    ),
    "gpu_memory_leak_slow": (
        # the drift detector's growth rate (model/drift.py): 10 MiB/s, the level barely above its peers
        [({"cuda_mem_growth_bytes_per_s": 10 * 2**20, "cuda_mem_live_bytes": 61e9}, {"cuda_mem_live_bytes": 1.5},
          {"cuda_mem_growth_bytes_per_s": 1.0})],
        [({"cuda_mem_live_bytes": 61e9}, {"cuda_mem_live_bytes": 1.5})],   # higher, not growing
    ),
    "host_memory_leak": (
        [({"proc_rss_growth_bytes_per_s": 8 * 2**20, "proc_rss_bytes": 9e9}, {}, {"proc_rss_growth_bytes_per_s": 1.0})],
        [({"proc_rss_bytes": 9e9}, {"proc_rss_bytes": 2})],
    ),
    "dataloader_input_stall": (
        [({"gpu_util": 30, "cpu_iowait_frac": 0.25, "torch_ops_per_s": 1500},
          {"cpu_iowait_frac": 5, "torch_ops_per_s": -5, "gpu_util": -5})],
        [({"gpu_util": 90, "cpu_iowait_frac": 0.3}, {"cpu_iowait_frac": 5}),   # IO waits, GPU still fed
         ({"gpu_util": 40, "cpu_iowait_frac": 0.02}, {"cpu_iowait_frac": 0.5, "torch_ops_per_s": -1})],
    ),
    "python_gc_storm": (
        [({"python_gc_frac": 0.3, "python_gc_per_s": 50}, {"python_gc_frac": 8, "python_gc_per_s": 6})],
        [({"python_gc_frac": 0.03}, {"python_gc_frac": 6}),
         ({"python_gc_frac": 0.1}, {"python_gc_frac": 0.5})],            # steady job-wide GC below 0.2
    ),
    "xid_hardware_error": (
        [({"gpu_xid_count": 2, "cuda_errors_per_s": 5}, {"gpu_xid_count": 10, "cuda_errors_per_s": 6})],
        [({"cuda_errors_per_s": 100}, {"cuda_errors_per_s": 8})],       # API errors alone are no hardware fault
    ),
    "gpu_ecc_row_remap": (
        [({"gpu_ecc_dbe_count": 1, "gpu_ecc_new_errors": 1}, {}, {"gpu_ecc_new_errors": 1.0}),
         ({"gpu_row_remap_pending": 2, "gpu_ecc_uncorrected": 3}, {}, {"gpu_row_remap_pending": 1.0})],
        [({"gpu_ecc_uncorrected": 3}, {}, {"gpu_util": 1.0})],     # an old count, nothing new, nothing pending
    ),
    "hung_collective": (
        [({"collective_stalled": 1}, {}, {"collective_stalled": 1.0})],
        [({"nccl_calls_per_s": 0.5}, {"nccl_calls_per_s": -4})],    # slow collectives are not a hang
    ),
    "job_wide_slowdown": (
        # every rank alike: the job's collective rate against its own history (model/job_rate.py)
        [({"job_iteration_time_ratio": 1.43, "job_collective_rate": 140.0, "job_rate_z": -15.0,
           "nccl_calls_per_s": 140.0}, {}, {"job_iteration_time_ratio": 1.43})],
        [({"job_iteration_time_ratio": 1.05, "job_rate_z": -2.0}, {})],   # within a healthy job's wobble
    ),
    "crashed_rank": (
        [({"rank_vanished": 1}, {}, {"rank_vanished": 1.0})],
        [({"torch_ops_per_s": 10}, {"torch_ops_per_s": -8})],       # a rank that slowed down still reports
    ),
    "pipeline_stage_imbalance": (
        [({"torch_op_time_frac": 0.9, "torch_ops_per_s": 9000, "torch_comm_wait_frac": 0.02},
          {"torch_op_time_frac": 6, "torch_ops_per_s": 5, "torch_comm_wait_frac": -7})],
        [({"torch_op_time_frac": 0.9}, {"torch_op_time_frac": 6, "torch_comm_wait_frac": -7}),  # same op count
         ({"torch_ops_per_s": 9000}, {"torch_ops_per_s": 5, "torch_comm_wait_frac": -7})],     # ops, not time
    ),
    "sequence_length_imbalance": (
        [({"torch_op_time_frac": 0.9, "torch_comm_wait_frac": 0.02},
          {"torch_op_time_frac": 6, "torch_comm_wait_frac": -7, "torch_ops_per_s": 0.4})],
        [({"torch_op_time_frac": 0.9}, {"torch_op_time_frac": 6, "torch_ops_per_s": 5,
                                        "torch_comm_wait_frac": -7}),   # more ops: more layers, not longer batches
         ({"torch_op_time_frac": 0.9}, {"torch_op_time_frac": 6})],     # computes more but nobody waits for it
    ),
    "ofu_regression": (
        [({"gpu_ofu": 0.12, "gpu_tensor_util": 0.15}, {"gpu_ofu": -6, "gpu_tensor_util": -5}),  # peers' GPUs do more
         ({"job_ofu_ratio": 0.4, "gpu_ofu": 0.16}, {}, {"gpu_ofu": 4.0})],   # the job's own history: 2.5x lower
        [({"gpu_ofu": 0.12, "gpu_throttled": 1}, {"gpu_ofu": -6}),          # clock-limited: throttling's
         ({"gpu_ofu": 0.05, "gpu_util": 20}, {"gpu_ofu": -6, "gpu_util": -8}),  # an idle, waiting GPU
         ({"job_ofu_ratio": 0.9}, {})],                                     # within its history's range
    ),
}
