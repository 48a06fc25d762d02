"""Workload (a): real 2-rank DDP training over gloo, started through torchrun."""
from __future__ import annotations

import json
import os
import time

import pytest

from fleetscope.eval.workloads.launch import DEBIAN_PYTHON, environ_of, launch, venv_site_packages


def test_two_rank_gloo_training_reports_steps_per_s_and_torchrun_identity(tmp_path):
    run = launch(2, ["--steps", "30", "--sleep-ms", "5"], run_id="evaltest-ddp", log_path=tmp_path / "run.log")
    try:
        pids = run.rank_pids()
        envs = {r: environ_of(p) for r, p in pids.items()}
        results = run.wait(60)
    finally:
        run.stop()
    assert sorted(pids) == [0, 1]
    for rank, env in envs.items():  # what the agent's identity resolver reads from /proc
        assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert env["TORCHELASTIC_RUN_ID"] == "evaltest-ddp" and env["MASTER_ADDR"] and env["MASTER_PORT"]
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["pid"] for r in results] == [pids[0], pids[1]]
    for r in results:
        assert r["steps"] == 30 and r["world_size"] == 2
        assert 1.0 < r["steps_per_s"] < 1000.0, r
    # DDP keeps replicas identical, but each rank saw its own data: losses differ.
    assert results[0]["loss"] != results[1]["loss"]


@pytest.mark.skipif(not os.path.exists(DEBIAN_PYTHON), reason=f"{DEBIAN_PYTHON} (the USDT Python) is not installed")
def test_runs_under_debian_python_with_gc_storm_knob(tmp_path):
    """Debian's python3.11 (USDT probes) with the venv on PYTHONPATH; the opt-in GC knob is read and applied."""
    control = tmp_path / "control"
    control.mkdir()
    (control / "rank1.json").write_text(json.dumps({"gc_storm": {"cycles_per_step": 2000}}))
    run = launch(2, ["--duration-s", "1.5", "--sleep-ms", "5"], python=DEBIAN_PYTHON,
                 site_packages=venv_site_packages(), env={"FLEETSCOPE_WORKLOAD_CONTROL_DIR": str(control)},
                 log_path=tmp_path / "run.log")
    try:
        pids = run.rank_pids()
        exe = os.readlink(f"/proc/{pids[0]}/exe")
        t0 = time.monotonic()
        results = run.wait(60)
    finally:
        run.stop()
    assert exe.startswith("/usr/bin/python3"), exe
    assert time.monotonic() - t0 < 60
    assert results[0]["faults_seen"] == [] and results[1]["faults_seen"] == ["gc_storm"]
    assert all(r["steps"] > 5 for r in results), results


def test_gpu_standin_plan_puts_each_fault_in_its_call():
    from fleetscope.eval.workloads.gpu_standin import StandinConfig, plan_step, step_time_us
    cfg = StandinConfig()
    base = {c.api: c for c in plan_step(cfg, 2)}
    assert [c.api for c in plan_step(cfg, 2)].count("cudaLaunchKernel") == cfg.kernels
    assert base["cudaMemcpy"].duration_us == pytest.approx(16e6 * 8 / 12e9 * 1e6)
    # ring all-reduce over 2 ranks: 2 hops of latency, 8 MB on the link at 20 Gbit/s
    assert base["ncclAllReduce"].duration_us == pytest.approx(2 * 50 + 8e6 * 8 / 20e9 * 1e6)
    stall = {c.api: c for c in plan_step(cfg, 2, {"memcpy_stall": {"extra_ms": 25}})}
    assert stall["cudaMemcpy"].duration_us - base["cudaMemcpy"].duration_us == pytest.approx(25_000)
    leak = plan_step(cfg, 2, {"gpu_memory_leak": {"bytes_per_step": 1 << 24}})
    assert [c.args for c in leak if c.api == "cudaMalloc"] == [{"bytes": 1 << 24, "free": False}]
    slow = {c.api: c for c in plan_step(cfg, 2, {"link_delay": {"delay_ms": 20, "bandwidth_mbps": 200}})}
    assert slow["ncclAllReduce"].duration_us == pytest.approx(2 * 20_050 + 8e6 * 8 / 0.2e9 * 1e6)
    assert 50_000 < step_time_us(plan_step(cfg, 2)) < 200_000
    with pytest.raises(ValueError, match="unknown stand-in knob"):
        plan_step(cfg, 2, {"gc_strom": {}})


def test_slow_storage_reads_from_the_device_and_blocks_for_the_batch_time(tmp_path):
    """The data-loader stall's fetch: uncached bytes the kernel counts as read from storage."""
    from fleetscope.eval.workloads.ddp_train import SlowStorage

    def read_bytes() -> int:
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])

    storage = SlowStorage(str(tmp_path), size_mb=8)
    try:
        storage.fetch(1, 0)  # creates the scratch file
        before, t0 = read_bytes(), time.monotonic()
        for _ in range(4):
            storage.fetch(2, 30)
        took, got = time.monotonic() - t0, read_bytes() - before
    finally:
        storage.close()
    assert got >= 4 * (2 << 20) * 0.9, got  # page cache dropped before each read
    assert took >= 4 * 0.030
    assert not list(tmp_path.iterdir())  # the scratch file is gone
