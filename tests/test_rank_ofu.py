"""OFU and tensor activity per rank and per job: the real NVML sampler, against the scripted NVML stand-in
(src/fleetscope/eval/gpu_stub/fake_nvml.c; this machine has no GPU), names each rank's GPU through NVML's
process lists; the real windows and feature builders, and the scorer's RankContext, give each rank its own
GPU's OFU and tensor activity, and the job their mean over its ranks."""
from __future__ import annotations

import shutil
import subprocess
from types import SimpleNamespace

import pynvml
import pytest

from fleetscope.producers.nvml.gpm import GPM_METRICS
from fleetscope.producers.nvml.sampler import NvmlSampler
from fleetscope.resources import package_dir
from fleetscope.schema import NODE_TENANT
from fleetscope.streams.features import window_features
from fleetscope.streams.rank_context import RankContext, job_gpu_means, joined_peer_z
from fleetscope.streams.windows import WindowAssembler

SEC = 10**9
T0 = 1_700_000_000 * SEC
TENSOR = {0: 60.0, 1: 20.0}          # % tensor-pipe activity of GPU 0 and GPU 1
CLOCK, CLOCK_MAX = 1500, 1980
PIDS = {0: 4242, 1: 4343}            # rank -> pid; rank r runs on GPU r


def scenario_text() -> str:
    lines = ["device_count 2"]
    for gpu in (0, 1):
        lines += [f"gpu {gpu} gpu_util 90", f"gpu {gpu} mem_util 40", f"gpu {gpu} sm_clock {CLOCK}",
                  f"gpu {gpu} sm_clock_max {CLOCK_MAX}", f"gpu {gpu} energy_mj " + " ".join(
                      str(1000 * k) for k in range(1, 40)), f"gpu {gpu} gpm_supported 1",
                  f"gpu {gpu} proc {PIDS[gpu]} 1048576", f"gpu {gpu} putil {PIDS[gpu]} 80 30"]
        lines += [f"gpu {gpu} gpm {mid} {TENSOR[gpu] if name == 'nvml.gpm.tensor_util' else 10.0}"
                  for mid, name in GPM_METRICS]
    return "\n".join(lines) + "\n"


@pytest.fixture
def sampler(tmp_path, monkeypatch):
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the NVML stand-in; install gcc")
    lib = tmp_path / "libnvidia-ml.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(lib),
                    str(package_dir("fleetscope.eval.gpu_stub") / "fake_nvml.c")], check=True)
    (tmp_path / "scenario.txt").write_text(scenario_text())
    monkeypatch.setenv("FAKE_NVML_SCENARIO", str(tmp_path / "scenario.txt"))
    ranks = {pid: rank for rank, pid in PIDS.items()}
    resolver = SimpleNamespace(resolve=lambda pid: SimpleNamespace(tenant="acme", job="llama", rank=ranks[pid])
                               if pid in ranks else None)
    s = NvmlSampler("node-a", resolver=resolver, library_path=str(lib))
    yield s
    s.close()
    with pynvml.libLoadLock:  # later tests must not be handed the stand-in
        pynvml.nvmlLib = None
        pynvml._nvmlGetFunctionPointer_cache.clear()


def test_each_rank_gets_its_own_gpus_ofu_and_the_job_their_mean(sampler):
    assembler = WindowAssembler(window_s=1.0, allowed_lateness_s=0, idle_close_s=60)
    for k in range(8):  # 4 ticks per window; GPM and OFU start on the second tick
        batch = sampler.sample(T0 + k * SEC // 4 + 1)
        assert batch is not None
        assembler.add(batch, None)
    windows = [w for w in assembler.pop_closed(force=True) if w.start_ns == T0 + SEC]
    node = [w for w in windows if w.key[0] == NODE_TENANT]
    ranks = sorted((w for w in windows if w.key[0] != NODE_TENANT), key=lambda w: w.key[3])
    assert len(node) == 1 and [w.key[:2] + (w.key[3],) for w in ranks] == [("acme", "llama", 0), ("acme", "llama", 1)]
    context = RankContext()
    context.remember(node[0], window_features(node[0]))
    joined = [{**context.joined(w), **window_features(w)} for w in ranks]
    for rank, vector in enumerate(joined):
        assert vector["gpu_tensor_util"] == pytest.approx(TENSOR[rank])          # its own GPU's, not the node mean
        assert vector["gpu_ofu"] == pytest.approx(TENSOR[rank] * CLOCK / CLOCK_MAX)
    assert job_gpu_means(joined) == {"job_gpu_ofu": pytest.approx(40.0 * CLOCK / CLOCK_MAX),
                                     "job_gpu_tensor_util": pytest.approx(40.0)}
    # the node window alone would have given both ranks the node's mean: 40 %
    assert window_features(node[0])["gpu_tensor_util"] == pytest.approx(40.0)


def test_peer_z_compares_ranks_on_their_own_gpus_ofu_and_ranks_without_gpm_are_left_out():
    vectors = [{"gpu_ofu": 40.0, "gpu_tensor_util": 50.0}, {"gpu_ofu": 41.0, "gpu_tensor_util": 51.0},
               {"gpu_ofu": 39.0, "gpu_tensor_util": 49.0}, {"gpu_ofu": 10.0, "gpu_tensor_util": 12.0}, {}]
    z = joined_peer_z(vectors)
    assert z[3]["gpu_ofu"] < -3 and z[3]["gpu_tensor_util"] < -3 and abs(z[0].get("gpu_ofu", 0.0)) < 1
    assert job_gpu_means(vectors) == {"job_gpu_ofu": pytest.approx(32.5), "job_gpu_tensor_util": pytest.approx(40.5)}
    assert job_gpu_means([{}, {"gpu_util": 90.0}]) == {}   # no GPM anywhere: masked, not zero
