"""Every feature name a builder of streams/features.py can emit, and on which windows.

One place, derived from the builders' own name tables where they have them.
``rank``: on a rank's own window (the model's vector, so peer z-scores exist).
``node``: on a node's window only (host counters, device-level NVML), joined
into a rank's vector as evidence: a KB rule can read the value, and the
JOINED_FEATURES among them get a peer z-score across the job's ranks
(streams/rank_context.py); LOUD_FEATURES come from the loud-failure checks. tests/test_feature_catalogue.py checks
this table against what the builders emit on real windows; the KB loader
(diagnosis/kb.py) checks every entry against it.
"""
from __future__ import annotations

from fleetscope.streams.arrival import ARRIVAL_FEATURES
from fleetscope.streams.host_features import CPU_STATES
from fleetscope.streams.proc_features import GAUGES, RATES
from fleetscope.streams.trace_features import COLLECTIVES, TORCH_CLASSES

_CPU = ("cpu_busy_frac", "cpu_busy_cores", "cpu_busy_max_core_frac",
        *(f"cpu_{s}_frac" for s in CPU_STATES if s not in ("nice", "idle")))
_MEMORY = ("mem_used_frac", "thp_coverage_frac", "hugepages_used_frac", "numa_miss_ratio", "page_faults_per_s",
           "major_faults_per_s")
_IO = ("irq_per_s", "net_rx_bytes_per_s", "net_tx_bytes_per_s", "disk_read_bytes_per_s", "disk_write_bytes_per_s",
       "context_switches_per_s")
_AGENT = ("agent_dropped_events", "agent_delivery_errors", "agent_spooled")
_GPU_FAULTS = ("gpu_xid_count", "gpu_xid_last_code", "gpu_xid_gpu", "gpu_ecc_dbe_count", "gpu_ecc_uncorrected",
               "gpu_row_remap_pending")

BUILDERS: dict[str, dict[str, tuple[str, ...]]] = {
    "host_features": {"rank": (), "node": _CPU + _MEMORY + _IO + _AGENT},
    "gpu_features": {"rank": ("gpu_energy_j", "gpu_proc_sm_util", "gpu_proc_mem_bytes"),
                     "node": ("gpu_energy_j", "gpu_util", "gpu_power_w", "gpu_ofu", "gpu_tensor_util",
                              "gpu_throttled", "gpu_temp_c", "gpu_sm_clock_mhz", *_GPU_FAULTS)},
    # the kernel tracer's node-wide rows (retransmits, per-CPU IRQs) land on the node's window
    "kernel_features": {"rank": ("offcpu_threads", "runq_wait_threads", "ctx_switches_per_s",
                                 "tcp_retransmits_per_s", "irq_traced_per_s"),
                        "node": ("tcp_retransmits_per_s", "irq_traced_per_s", "irq_max_cpu_share")},
    "proc_features": {"rank": tuple(name for _, name, _ in RATES) + tuple(name for _, name in GAUGES), "node": ()},
    "cuda_features": {"rank": ("cuda_launch_per_s", "cuda_sync_frac", "cuda_memcpy_frac", "cuda_memcpy_bytes_per_s",
                               "cuda_memcpy_htod_bytes_per_s", "cuda_memcpy_lat_p50_ns", "cuda_memcpy_lat_p99_ns",
                               "cuda_mem_live_bytes", "cuda_pinned_live_bytes", "cuda_malloc_free_balance_bytes",
                               "cuda_errors_per_s"),
                      "node": ()},
    "nccl_features": {"rank": ("nccl_calls_per_s", "nccl_bytes_per_s", "nccl_time_frac", "nccl_algbw_gbps",
                               "nccl_lat_p50_ns", "nccl_lat_p99_ns", "nccl_sync_wait_frac",
                               *(f"nccl_{op.lower()}_lat_p99_ns" for op in COLLECTIVES),
                               *(f"nccl_{op.lower()}_algbw_gbps" for op in COLLECTIVES)), "node": ()},
    "python_features": {"rank": ("python_gc_frac", "python_gc_per_s", "python_calls_per_s", "python_top_func_share"),
                        "node": ()},
    # streams/stack_signature.py: the id of the rank's top sampled Python function (a category, not a quantity)
    "top_frame_features": {"rank": ("python_top_frame_id",), "node": ()},
    # streams/exit_features.py: a crashed process of the rank, in the window it ended (events, not quantities)
    "exit_features": {"rank": ("process_exit_abnormal", "process_exit_signal"), "node": ()},
    "torch_features": {"rank": ("torch_ops_per_s", *(f"torch_{cls}_ops_per_s" for cls, _ in TORCH_CLASSES),
                                "torch_other_ops_per_s", "torch_op_time_frac", "torch_comm_wait_frac",
                                "torch_comm_waits_per_s", "torch_work_wait_frac", "torch_collectives_per_s"),
                      "node": ()},
}

RANK_FEATURES = frozenset(n for b in BUILDERS.values() for n in b["rank"])
NODE_FEATURES = frozenset(n for b in BUILDERS.values() for n in b["node"])
# Node features the scorer joins into each rank's vector (streams/rank_context.py: the rank's own GPU's
# where its NVML process rows name it) and compares across the job's ranks with a peer z of their own.
JOINED_FEATURES = frozenset(("gpu_util", "gpu_power_w", "gpu_ofu", "gpu_tensor_util", "gpu_throttled", "gpu_temp_c",
                             "gpu_sm_clock_mhz",
                             "thp_coverage_frac", "page_faults_per_s", "numa_miss_ratio", "irq_max_cpu_share",
                             "cpu_softirq_frac", "cpu_busy_frac")) & NODE_FEATURES
# Derived by the scorer's loud-failure checks (streams/model/loud.py), on the rank they blame.
LOUD_FEATURES = frozenset(("rank_vanished", "rank_crashed", "collective_stalled", "gpu_ecc_new_errors"))
# A job's aggregate of its ranks' own GPUs per window (streams/rank_context.job_gpu_means over one step's
# joined vectors), added by the scorer to every rank's evidence: the job's OFU, for comparing a job with
# its own history (job_ofu_ratio).
JOB_GPU_FEATURES = frozenset(("job_gpu_ofu", "job_gpu_tensor_util"))
# Computed at the join from the rank's window and its node's (streams/rank_context.py, irq_features.py):
# the rank's CPUs' share of the node's device interrupts, and their time in interrupt work; peer z'd like
# JOINED_FEATURES.
RANK_JOIN_FEATURES = frozenset(("irq_rank_cpu_share", "irq_time_rank_cpu_frac"))
# Ids, not quantities (streams/stack_signature.py): compared for equality by the loud checks, never scored
# by a model nor peer z'd (stack_signature.model_input leaves them out of the model's vector).
CATEGORICAL_FEATURES = frozenset(("python_top_frame_id",))
# Events, present only in the window they happen in (streams/exit_features.py): read by the loud checks,
# never scored by a model nor peer z'd, like the categorical ids.
EVENT_FEATURES = frozenset(("process_exit_abnormal", "process_exit_signal"))
# Compared across a job step's ranks (streams/arrival.py, on the feature sink's windows): who enters each
# collective last. Role inputs and evidence; a model scoring a rank on its peers' timing would flag the
# waiting peers with the culprit, so they stay out of the models and the peer z.
STEP_FEATURES = frozenset(ARRIVAL_FEATURES)
NOT_MODEL_INPUTS = CATEGORICAL_FEATURES | EVENT_FEATURES | STEP_FEATURES
PEER_Z_FEATURES = (RANK_FEATURES | JOINED_FEATURES | RANK_JOIN_FEATURES) - NOT_MODEL_INPUTS
# Derived by the scorer from the job's own history (streams/model/job_rate.py), on every rank of a step.
JOB_FEATURES = frozenset(("job_collective_rate", "job_rate_z", "job_iteration_time_ratio", "job_ofu_ratio"))
# Derived by the scorer per host of a job step (streams/model/outside_load.py): the host's busy CPU less the
# job's ranks' own, against the (job, host)'s history; on every rank of that host. And per rank, the share of its
# own CPUs' time that work outside the job took (streams/cpu_features.py).
OUTSIDE_FEATURES = frozenset(("outside_cpu_cores", "outside_cpu_z", "outside_cpu_rise_cores", "outside_rank_cpu_frac"))
# Derived by the scorer's drift detector (streams/model/drift.py), on the rank whose memory grows.
DRIFT_FEATURES = frozenset(("cuda_mem_growth_bytes_per_s", "proc_rss_growth_bytes_per_s"))
# Derived by the scorer on the ranks it names behind a slow link, in a step whose job's rate fell
# (streams/model/receive_wakeups.py): wakeups per collective over the last windows against the peers' median.
LINK_FEATURES = frozenset(("link_wakeup_ratio",))
ALL_FEATURES = (RANK_FEATURES | NODE_FEATURES | RANK_JOIN_FEATURES | LOUD_FEATURES | JOB_GPU_FEATURES | JOB_FEATURES
                | OUTSIDE_FEATURES | DRIFT_FEATURES | STEP_FEATURES | LINK_FEATURES)
