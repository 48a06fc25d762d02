"""Workload (b), the GPU-job stand-in, as the runner starts it.

benchmarks/workloads/gpu_standin.py (another engineer's) plans each step's CUDA/NCCL
calls; driving the libcudart/libnccl stand-ins with that plan is not wired yet, so
scenarios that need it are skipped with this reason instead of being faked.
"""
from __future__ import annotations


def unavailable() -> str | None:
    """Why the stand-in workload cannot run here, or None when it can."""
    from benchmarks.workloads import gpu_standin
    if not hasattr(gpu_standin, "launch"):
        return ("the GPU stand-in workload (benchmarks/workloads/gpu_standin.py) cannot run yet: it only plans "
                "a step's calls and does not drive the libcudart/libnccl stand-ins; no GPU here either")
    return None


def launch(ranks: int, env: dict, data_dir, workload_args: dict):
    """Start the stand-in's ranks through its own launch(); same interface as launch.Launch."""
    from benchmarks.workloads import gpu_standin
    return gpu_standin.launch(ranks, env=env, log_path=data_dir / "workload.log", **workload_args)
