"""Which subsystem a feature belongs to: one ordered table, first match wins.

The names are those of the feature catalog (streams/features.py and its
builders). A feature that matches no row (agent_dropped_events: a property of
the agent, not the job) is left out of attribution; callers count it.
"""
from __future__ import annotations

from fnmatch import fnmatchcase
from functools import lru_cache

# Fixed order: fingerprints are vectors over exactly these, in this order.
SUBSYSTEMS: tuple[str, ...] = (
    "cpu", "gpu_compute", "gpu_memory", "interconnect", "network",
    "storage", "nccl", "cuda_runtime", "framework", "host_memory",
)

# (glob over the feature name, subsystem). Specific rows before general ones.
FEATURE_SUBSYSTEM: tuple[tuple[str, str], ...] = (
    # storage: waiting on disks, and disk traffic
    ("cpu_iowait_frac", "storage"),
    ("disk_*", "storage"),
    ("proc_read_bytes_per_s", "storage"),
    ("proc_write_bytes_per_s", "storage"),
    # network: NIC traffic, TCP, and where the (mostly NIC) interrupts land
    ("net_*", "network"),
    ("tcp_*", "network"),
    ("irq_*", "network"),
    # the job's OFU against its own history (model/job_rate.py, rank_context.job_gpu_means): tensor work
    ("job_ofu_ratio", "gpu_compute"),
    ("job_gpu_*", "gpu_compute"),
    # the job against its own history (model/job_rate.py): its iteration time, the framework's pace
    ("job_*", "framework"),
    # cpu: time split, scheduling, off-CPU threads
    ("cpu_*", "cpu"),
    ("context_switches_per_s", "cpu"),
    ("ctx_switches_per_s", "cpu"),
    ("offcpu_threads", "cpu"),
    ("runq_wait_threads", "cpu"),
    ("proc_cpu_cores", "cpu"),
    ("proc_vol_ctx_per_s", "cpu"),
    ("proc_invol_ctx_per_s", "cpu"),
    ("proc_threads", "cpu"),
    # host memory: NUMA placement, huge pages, faults
    ("mem_used_frac", "host_memory"),
    ("thp_coverage_frac", "host_memory"),
    ("hugepages_used_frac", "host_memory"),
    ("numa_*", "host_memory"),
    ("page_faults_per_s", "host_memory"),
    ("major_faults_per_s", "host_memory"),
    ("proc_minflt_per_s", "host_memory"),
    ("proc_majflt_per_s", "host_memory"),
    ("proc_rss_bytes", "host_memory"),
    # GPU memory: device allocations
    ("gpu_proc_mem_bytes", "gpu_memory"),
    ("cuda_mem_live_bytes", "gpu_memory"),
    ("cuda_mem_growth_bytes_per_s", "gpu_memory"),
    ("proc_rss_growth_bytes_per_s", "host_memory"),
    ("cuda_malloc_free_balance_bytes", "gpu_memory"),
    ("gpu_ecc_*", "gpu_memory"),
    ("gpu_row_remap_*", "gpu_memory"),
    # GPU compute: utilization, clocks, power, thermals, XIDs
    ("gpu_*", "gpu_compute"),
    # interconnect (PCIe/NVLink): host<->device copies
    ("cuda_memcpy_*", "interconnect"),
    # CUDA runtime API: launches, syncs, errors
    ("cuda_*", "cuda_runtime"),
    # collectives (gloo's waits for peers, seen through libtorch_cpu, are the CPU jobs' NCCL)
    ("nccl_*", "nccl"),
    ("torch_comm_wait_frac", "nccl"),
    ("torch_comm_waits_per_s", "nccl"),
    ("torch_work_wait_frac", "nccl"),
    ("collective_stalled", "nccl"),
    # a rank that stopped reporting, or whose process crashed: its process (the framework's) is gone
    ("rank_vanished", "framework"),
    ("rank_crashed", "framework"),
    ("process_exit_*", "framework"),
    # framework
    ("python_*", "framework"),
    ("torch_*", "framework"),
)

@lru_cache(maxsize=4096)
def subsystem_of(feature: str) -> str | None:
    """The subsystem of a feature name, or None when no row matches."""
    return next((sub for pattern, sub in FEATURE_SUBSYSTEM if fnmatchcase(feature, pattern)), None)


def _check_table() -> None:
    unknown = {sub for _, sub in FEATURE_SUBSYSTEM} - set(SUBSYSTEMS)
    if unknown:
        raise ValueError(f"FEATURE_SUBSYSTEM names unknown subsystems {sorted(unknown)}")


_check_table()
