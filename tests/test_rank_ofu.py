"""OFU and tensor activity per rank and per job: the real NVML sampler, against the scripted NVML stand-in
(src/fleetscope/eval/gpu_stub/fake_nvml.c; this machine has no GPU), names each rank's GPU through NVML's
process lists; the real windows and feature builders, and the scorer's RankContext, give each rank its own
GPU's OFU and tensor activity, and the job their mean over its ranks."""
from __future__ import annotations

import shutil
import subprocess
import time
from types import SimpleNamespace

import pynvml
import pytest

from fleetscope.config import Config
from fleetscope.producers.nvml.gpm import GPM_METRICS
from fleetscope.producers.nvml.sampler import NvmlSampler
from fleetscope.resources import package_dir
from fleetscope.schema import NODE_TENANT
from fleetscope.streams.features import window_features
from fleetscope.streams.processor import MessageRef, StreamProcessor
from fleetscope.streams.rank_context import RankContext, job_gpu_means, joined_peer_z
from fleetscope.streams.windows import WindowAssembler
from fleetscope.wire import encode

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
def stand_in(tmp_path, monkeypatch):
    """The NVML stand-in library, built here, and the scenario file it reads (written by the test)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the NVML stand-in; install gcc")
    lib = tmp_path / "libnvidia-ml.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(lib),
                    str(package_dir("fleetscope.eval.gpu_stub") / "fake_nvml.c")], check=True)
    monkeypatch.setenv("FAKE_NVML_SCENARIO", str(tmp_path / "scenario.txt"))
    yield lib, tmp_path / "scenario.txt"
    with pynvml.libLoadLock:  # later tests must not be handed the stand-in
        pynvml.nvmlLib = None
        pynvml._nvmlGetFunctionPointer_cache.clear()


def new_sampler(lib) -> NvmlSampler:
    ranks = {pid: rank for rank, pid in PIDS.items()}
    resolver = SimpleNamespace(resolve=lambda pid: SimpleNamespace(tenant="acme", job="llama", rank=ranks[pid])
                               if pid in ranks else None)
    return NvmlSampler("node-a", resolver=resolver, library_path=str(lib))


@pytest.fixture
def sampler(stand_in):
    lib, scenario = stand_in
    scenario.write_text(scenario_text())
    s = new_sampler(lib)
    yield s
    s.close()


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


HEALTHY_WINDOWS = 12                       # GPM readings per GPU before the regression (the stand-in's series)
REGRESSED = {0: 24.0, 1: 8.0}              # tensor activity after it: 0.4x, the seed's 2.5x OFU regression


def regression_scenario() -> str:
    """The two-GPU node of scenario_text, without energy counters, whose GPUs' tensor activity falls to 0.4x
    after HEALTHY_WINDOWS readings (the stand-in repeats a series' last value)."""
    lines = ["device_count 2"]
    for gpu in (0, 1):
        lines += [f"gpu {gpu} gpu_util 90", f"gpu {gpu} mem_util 40", f"gpu {gpu} sm_clock {CLOCK}",
                  f"gpu {gpu} sm_clock_max {CLOCK_MAX}", f"gpu {gpu} gpm_supported 1",
                  f"gpu {gpu} proc {PIDS[gpu]} 1048576", f"gpu {gpu} putil {PIDS[gpu]} 80 30"]
        tensor = " ".join([str(TENSOR[gpu])] * HEALTHY_WINDOWS + [str(REGRESSED[gpu])])
        lines += [f"gpu {gpu} gpm {mid} {tensor if name == 'nvml.gpm.tensor_util' else 10.0}"
                  for mid, name in GPM_METRICS]
    return "\n".join(lines) + "\n"


def test_a_job_whose_ofu_falls_against_its_own_history_is_flagged_and_diagnosed_ofu_regression(stand_in, store, tmp_path):
    """Both GPUs of the job fall alike to 0.4x their tensor activity: no rank differs from its peer, the job's
    own history does. The real NVML sampler (against the stand-in) feeds the real stream processor (windows,
    features, RankContext join, job_gpu_means, JobRates, KB) on chDB: every rank of every regressed window
    is flagged with role job, detector job_ofu, and diagnosed ofu_regression with job_ofu_ratio ~0.4.
    (The node's own model is still warming up in these 24 windows: 1 row per window.)"""
    lib, scenario = stand_in
    scenario.write_text(regression_scenario())
    nvml = new_sampler(lib)
    t0 = (time.time_ns() // SEC // 3600 - 24) * 3600 * SEC     # inside the store's TTL and the skew bound
    clock = SimpleNamespace(now=0.0)
    cfg = Config(data_dir=tmp_path, window_s=1.0, allowed_lateness_s=0.5, idle_close_s=30, warmup_windows=5,
                 model_checkpoint_s=0)
    proc = StreamProcessor(cfg, store, clock=lambda: clock.now)
    try:
        for k in range(24):                      # one reading per 1 s window
            clock.now = float(k)
            batch = nvml.sample(t0 + k * SEC + SEC // 2)
            assert batch is not None
            proc.handle(encode(batch), None, MessageRef("fleetscope.raw.nvml", 0, k))
            proc.flush()
    finally:
        nvml.close()
    ofu = {(ms * 10**6 - t0) // SEC: v for ms, v in store.query(
        "SELECT toUnixTimestamp64Milli(window_start), feature['job_gpu_ofu'] FROM anomalies FINAL "
        "WHERE tenant = 'acme' AND rank = 0").rows}
    rows = store.query("SELECT rank, toUnixTimestamp64Milli(window_start), detectors, role, feature FROM anomalies "
                       "FINAL WHERE tenant = 'acme'").rows
    flagged = {(r, (ms * 10**6 - t0) // SEC): (dets, role, f) for r, ms, dets, role, f in rows}
    regressed = sorted({w for (_, w), (_, _, f) in flagged.items() if f["job_ofu_ratio"] < 0.5})
    assert regressed, (ofu, sorted(flagged))
    first = regressed[0]
    assert regressed == list(range(first, 23)), regressed          # every regressed window, to the end
    for w in regressed:
        for r in (0, 1):
            dets, role, f = flagged[(r, w)]
            assert "job_ofu" in dets and role == "job", (r, w, dets, role)
            assert f["job_ofu_ratio"] == pytest.approx(0.4, rel=0.02)
            assert f["job_gpu_ofu"] == pytest.approx(16.0 * CLOCK / CLOCK_MAX, rel=0.02)
    # healthy windows, the job's OFU at its baseline: none flagged
    assert not [k for k in flagged if k[1] < first], sorted(flagged)
    diag = store.query(f"SELECT rank, kb_entry FROM diagnoses FINAL WHERE tenant = 'acme' AND window_start = "
                       f"fromUnixTimestamp64Nano(toInt64({t0 + first * SEC})) ORDER BY rank, confidence DESC").rows
    best = {}
    for r, entry in diag:
        best.setdefault(r, entry)
    assert best == {0: "ofu_regression", 1: "ofu_regression"}, diag
    # the first two regressed steps confirm it (alert_confirm "3 of 5"): flagged by job_ofu, stored unflagged
    snap = proc.snapshot()
    assert snap["model_job_ofu_flags"] == len(regressed) + 2 and snap["model_unconfirmed"] == 2 * 2, snap
