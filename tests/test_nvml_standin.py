"""The evaluation's NVML stand-in (fleetscope.eval.nvml_standin): fake GPUs that faults change mid-run.

Stand-in: libnvidia-ml itself (gpu_stub/fake_nvml.c, built with gcc here; this machine has no GPU). Real: pynvml's
ctypes calls, the agent's NvmlSampler and XidWatcher, the control file the library re-reads while in use, and the
fault injector that writes it.
"""
from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pynvml
import pytest

from fleetscope import wire
from fleetscope.eval.faults import FaultError, GpuThrottle, WorkloadKnob, make_fault
from fleetscope.eval.nvml_standin import HEALTHY, NvmlStandin, NvmlStandinError, throttled_values
from fleetscope.eval.scenario import load_scenario
from fleetscope.producers.nvml.sampler import NvmlSampler
from fleetscope.producers.nvml.xid_watcher import XidWatcher

SEC = 1_000_000_000
RELOAD_S = 0.25   # the library stat()s its control file at most every 100 ms


class Resolver:
    def __init__(self, table: dict[int, int]):
        self.table = table   # pid -> rank

    def resolve(self, pid: int):
        rank = self.table.get(pid)
        return None if rank is None else SimpleNamespace(tenant="t", job="j", rank=rank)


def rows(batch) -> list[dict]:
    assert batch is not None
    cols = {k: (v.to_numpy() if isinstance(v, wire.StrColumn) else v) for k, v in batch.columns.items()}
    return [{k: (c[i].item() if hasattr(c[i], "item") else c[i]) for k, c in cols.items()} for i in range(batch.count)]


def device(values: list[dict], metric: str, gpu: int) -> float:
    found = [r["value"] for r in values if r["metric"] == metric and r["device"] == f"gpu{gpu}" and r["pid"] == 0]
    assert len(found) == 1, (metric, gpu, found)
    return found[0]


@pytest.fixture
def standin(tmp_path, monkeypatch):
    s = NvmlStandin(tmp_path / "nvml", gpus=2).build()
    for key, value in s.env().items():
        monkeypatch.setenv(key, value)
    yield s
    s.release()


def test_a_fault_changes_what_the_sampler_reads_mid_run_and_clearing_it_restores_the_healthy_gpu(standin):
    sampler = NvmlSampler("node-a", resolver=Resolver({4242: 0, 4343: 1}), library_path=str(standin.library))
    try:
        standin.set_processes({0: 4242, 1: 4343})
        time.sleep(RELOAD_S)
        healthy = rows(sampler.sample(1 * SEC))
        assert device(healthy, "nvml.sm_clock_mhz", 1) == HEALTHY["sm_clock"]
        assert device(healthy, "nvml.throttle.sw_power_cap", 1) == 0.0
        # each rank's process on its own GPU, with the rank's identity: what ties a GPU's features to a rank
        procs = {(r["pid"], r["device"], r["rank"]) for r in healthy if r["metric"] == "nvml.proc_mem_used"}
        assert procs == {(4242, "gpu0", 0), (4343, "gpu1", 1)}

        standin.override("throttle", 1, **throttled_values(1.0))
        time.sleep(RELOAD_S)
        throttled = rows(sampler.sample(2 * SEC))
        assert device(throttled, "nvml.sm_clock_mhz", 1) == HEALTHY["sm_clock"] // 2
        assert device(throttled, "nvml.throttle.sw_power_cap", 1) == 1.0
        assert device(throttled, "nvml.throttle.hw_thermal_slowdown", 1) == 1.0
        assert device(throttled, "nvml.temp_c", 1) == 87
        assert device(throttled, "nvml.sm_clock_mhz", 0) == HEALTHY["sm_clock"]   # the other GPU is untouched
        assert device(throttled, "nvml.throttle.sw_power_cap", 0) == 0.0

        standin.clear("throttle")
        time.sleep(RELOAD_S)
        after = rows(sampler.sample(3 * SEC))
        assert device(after, "nvml.sm_clock_mhz", 1) == HEALTHY["sm_clock"]
        assert device(after, "nvml.throttle.sw_power_cap", 1) == 0.0
        assert {r["pid"] for r in after if r["metric"] == "nvml.proc_mem_used"} == {4242, 4343}
    finally:
        sampler.close()


def test_an_xid_written_mid_run_reaches_the_watcher_once_per_change(standin):
    published: list = []
    watcher = XidWatcher("node-a", published.append, library_path=str(standin.library), wait_ms=20).start()
    try:
        time.sleep(RELOAD_S)
        assert not any(r["metric"] == "nvml.xid" for b in published for r in rows(b))
        standin.override("xid", 1, xid=79)

        def xids():
            return [(r["device"], r["value"]) for b in published for r in rows(b) if r["metric"] == "nvml.xid"]
        deadline = time.monotonic() + 10
        while not xids() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert xids() == [("gpu1", 79.0)]
        time.sleep(3 * RELOAD_S)
        assert xids() == [("gpu1", 79.0)], "an unchanged control file delivers its Xid once"
        standin.clear("xid")
        standin.override("xid", 0, xid=48)
        deadline = time.monotonic() + 10
        while len(xids()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert xids() == [("gpu1", 79.0), ("gpu0", 48.0)]
    finally:
        watcher.stop()


def test_release_leaves_no_stand_in_behind(tmp_path, monkeypatch):
    s = NvmlStandin(tmp_path / "nvml", gpus=1).build()
    for key, value in s.env().items():
        monkeypatch.setenv(key, value)
    sampler = NvmlSampler("node-a", resolver=None, library_path=str(s.library))
    assert rows(sampler.sample(SEC))
    sampler.close()
    s.release()
    assert pynvml.nvmlLib is None
    assert not set(s.env()) & set(os.environ)


def test_gpu_throttle_with_the_stand_in_sets_the_knob_and_nvml_together_and_undoes_both(tmp_path):
    nvml = NvmlStandin(tmp_path / "nvml", gpus=3)
    nvml.control.parent.mkdir(parents=True)
    control_dir = tmp_path / "control"
    control_dir.mkdir()
    fault = make_fault("gpu_throttle", rank=2, strength=0.5, control_dir=control_dir, nvml=nvml)
    assert isinstance(fault, GpuThrottle)
    with fault:
        assert json.loads((control_dir / "rank2.json").read_text()) == {"gpu_throttle": {"kernel_slowdown": 0.5}}
        lines = nvml.control.read_text().split("\n")
        assert f"gpu 2 sm_clock {int(HEALTHY['sm_clock'] / 1.5)}" in lines and "gpu 2 throttle 68" in lines
        assert fault.describe()["nvml"]["gpu"] == 2
    assert not (control_dir / "rank2.json").exists()
    assert nvml.control.read_text().strip() == ""
    # without the stand-in the fault is the workload's knob alone, as before
    assert type(make_fault("gpu_throttle", rank=0, control_dir=control_dir)) is WorkloadKnob


def test_the_stand_in_refuses_gpus_it_does_not_have(tmp_path):
    with pytest.raises(NvmlStandinError, match="1 to 8"):
        NvmlStandin(tmp_path, gpus=9)
    s = NvmlStandin(tmp_path, gpus=2)
    with pytest.raises(NvmlStandinError, match="GPU 2"):
        s.override("f", 2, throttle=4)


def test_a_scenario_may_require_the_nvml_stand_in(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nworkload: gpu_standin\nranks: 3\nduration_s: 60\nwindow_s: 1\n"
                    "requires: [gpu_standin, nvml_standin]\nfaults: []\n")
    assert "nvml_standin" in load_scenario(path).requires
    path.write_text(path.read_text().replace("nvml_standin", "nvml_stub"))
    with pytest.raises(Exception, match="requires"):
        load_scenario(path)


def test_an_xid_fault_reports_the_xid_on_the_ranks_gpu_then_ends_the_rank(standin):
    """gpu_xid (eval/faults.py): the watcher reads Xid 79 on the rank's GPU, and the rank's process (a real one
    here) is then killed, as a process whose GPU fell off the bus ends. A scenario must load the stand-in."""
    import subprocess
    import sys
    published: list = []
    watcher = XidWatcher("node-a", published.append, library_path=str(standin.library), wait_ms=20).start()
    rank_process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(RELOAD_S)
        fault = make_fault("gpu_xid", pid=rank_process.pid, rank=1, params={"code": 79}, nvml=standin)
        fault.start()
        assert rank_process.wait(10) == -9
        deadline = time.monotonic() + 10
        while not published and time.monotonic() < deadline:
            time.sleep(0.05)
        xids = [(r["device"], r["value"]) for b in published for r in rows(b) if r["metric"] == "nvml.xid"]
        assert xids == [("gpu1", 79.0)]
        assert fault.describe() == {"kind": "gpu_xid", "xid": 79, "gpu": 1,
                                    "then": {"kind": "crash", "pid": rank_process.pid, "killed": True}}
        fault.stop()
        assert standin.control.read_text().count("xid") == 0
    finally:
        rank_process.kill()
        watcher.stop()
    with pytest.raises(FaultError, match="nvml_standin"):
        make_fault("gpu_xid", pid=os.getpid(), rank=0)


def test_a_scenario_with_an_xid_fault_must_load_the_nvml_stand_in(tmp_path):
    path = tmp_path / "s.yaml"
    body = ("name: s\nworkload: gpu_standin\nranks: 3\nduration_s: 60\nwindow_s: 1\nrequires: [gpu_standin{extra}]\n"
            "faults:\n  - {{kind: gpu_xid, rank: 1, start_s: 30, duration_s: 1, expect: {{kb_entry: xid_hardware_error}}}}\n")
    path.write_text(body.format(extra=", nvml_standin"))
    fault = load_scenario(path).faults[0]
    assert fault.expect.persists and fault.expect.kb_entry == "xid_hardware_error"
    path.write_text(body.format(extra=""))
    with pytest.raises(Exception, match="requires: a gpu_xid fault"):
        load_scenario(path)
