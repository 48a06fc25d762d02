"""The feature vector of a window: a fixed, versioned, named set.

Each source contributes through one builder; a builder leaves out what its
inputs cannot support, so absent keys mean "masked", never zero.
"""
from __future__ import annotations

from fleetscope.streams.exit_features import exit_features
from fleetscope.streams.gpu_features import gpu_features
from fleetscope.streams.host_features import host_features
from fleetscope.streams.kernel_features import kernel_features
from fleetscope.streams.proc_features import proc_features
from fleetscope.streams.stack_signature import top_frame_features
from fleetscope.streams.trace_features import cuda_features, nccl_features, python_features, torch_features
from fleetscope.streams.windows import Window

FEATURE_VERSION = 11  # 2: CUDA, NCCL, Python and PyTorch features; 3: per-process /proc features (proc_*);
#                      4: gloo collective waits (torch_comm_wait_frac, torch_work_wait_frac, torch_comm_waits_per_s);
#                      5: cuda_pinned_live_bytes, python_top_func_share from py-spy samples without USDT;
#                      6: nccl_sync_wait_frac (the first sync after a collective);
#                      7: process_exit_abnormal, process_exit_signal (a rank's crashed process);
#                      8: nccl_arrival_lag_s, nccl_arrival_wait_frac (across a step's ranks, streams/arrival.py);
#                      9: those renamed arrival_lag_s, arrival_wait_frac: gloo's marks feed them too;
#                      10: torch_collectives_per_s (gloo collectives issued, from the always-on marks);
#                      11: cpu_busy_cores (the host's busy CPU in cores, for model/outside_load.py)
BUILDERS = (host_features, gpu_features, kernel_features, proc_features, cuda_features, nccl_features,
            python_features, top_frame_features, torch_features, exit_features)


def window_features(window: Window) -> dict[str, float]:
    out: dict[str, float] = {}
    for build in BUILDERS:
        out.update(build(window))
    return out
