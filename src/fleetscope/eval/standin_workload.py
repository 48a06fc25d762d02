"""Workload (b), the GPU-job stand-in, as the runner starts it.

benchmarks/workloads/gpu_standin.py (another engineer's) drives the libcudart/libnccl
stand-ins (no GPU here) with a realistic per-step plan; while a version without its
launch() is checked out, scenarios that need it are skipped with the reason.
"""
from __future__ import annotations


def unavailable() -> str | None:
    """Why the stand-in workload cannot run here, or None when it can."""
    from fleetscope.eval.workloads import gpu_standin
    if not hasattr(gpu_standin, "launch"):
        return ("the GPU stand-in workload (benchmarks/workloads/gpu_standin.py) cannot run yet: it only plans "
                "a step's calls and does not drive the libcudart/libnccl stand-ins; no GPU here either")
    return None


def launch(ranks: int, env: dict, data_dir, workload_args: dict, run_id: str, rank_args: dict | None = None):
    """Start the stand-in's ranks through its own launch() (they get TORCHELASTIC_RUN_ID = run_id,
    the job the runner waits for); same interface as launch.Launch."""
    from fleetscope.eval.workloads import gpu_standin
    return gpu_standin.launch(ranks, env=env, log_path=data_dir / "workload.log", run_id=run_id,
                              rank_args=rank_args, **workload_args)
