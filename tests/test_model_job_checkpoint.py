"""The job's detectors outside its model (model/job_rate.py, model/drift.py) travel in the model's checkpoint:
plain arrays and numbers (no pickle), restored into fresh detectors that then judge exactly as an
uninterrupted one. The inputs are the job-step vectors the scorer hands them (feature names as emitted)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from fleetscope.streams.model import JobModel, ModelConfig
from fleetscope.streams.model.drift import MemoryDrift
from fleetscope.streams.model.job_rate import JobRates
from fleetscope.streams.model.state_archive import CheckpointError

SEC = 10**9
JOB = ("acme", "train")
MEMBERS = [("node-a", r) for r in range(4)]


def step_vectors(k: int, rng) -> list[dict]:
    """Window k of a 4-rank job: collective rate 40/s, slowly drifting down from window 30 (Page-Hinkley's
    case), OFU 30 falling to 12 at window 45; rank 1's device memory leaks 10 MiB/s from window 20."""
    rate = 40.0 * (1 - max(0, k - 30) * 0.01)
    ofu = 30.0 if k < 45 else 12.0
    out = []
    for r in range(4):
        live = 2 * 2**30 + rng.normal(0, 2**19) + (max(0, k - 20) * 10 * 2**20 if r == 1 else 0)
        out.append({"nccl_calls_per_s": rate * (1 + 0.01 * rng.standard_normal()), "job_gpu_ofu": ofu,
                    "cuda_mem_live_bytes": live})
    return out


def judge(rates: JobRates, drift: MemoryDrift, k: int, vectors) -> tuple:
    r = rates.step(JOB, k * SEC, vectors)
    d = drift.step(JOB, k * SEC, MEMBERS, vectors)
    return (r.flagged, r.ofu_flagged, r.features), [(f.index, f.features) for f in d]


def test_restored_job_rate_and_drift_detectors_judge_like_uninterrupted_ones():
    rng = np.random.default_rng(5)
    steps = [step_vectors(k, rng) for k in range(70)]
    whole = (JobRates(warmup=10), MemoryDrift())
    first = (JobRates(warmup=10), MemoryDrift())
    for k in range(25):                                     # the leak has begun, the rate not yet drifted
        judge(*whole, k, steps[k])
        judge(*first, k, steps[k])
    model = JobModel(ModelConfig(warmup_windows=5))
    blob = model.to_bytes({"job_rate": first[0].part(JOB), "drift": first[1].part(JOB)})
    assert b"pickle" not in blob and b"river" not in blob
    restored = (JobRates(warmup=10), MemoryDrift())
    JobModel.from_bytes(blob, {"job_rate": restored[0].part(JOB), "drift": restored[1].part(JOB)})
    fresh = (JobRates(warmup=10), MemoryDrift())            # what a restart without the parts gives
    got, want, relearnt = [], [], []
    for k in range(25, 70):
        want.append(judge(*whole, k, steps[k]))
        got.append(judge(*restored, k, steps[k]))
        relearnt.append(judge(*fresh, k, steps[k]))
    assert got == want
    # the test has teeth: the uninterrupted run flags the drift, the OFU fall and the leak, and a worker
    # that relearnt from scratch would not judge alike
    assert any(r[0] for r, _ in want) and any(r[1] for r, _ in want) and any(d for _, d in want)
    assert relearnt != want


def test_a_checkpoint_read_without_the_parts_still_gives_the_model_and_bad_parts_are_refused():
    rates, drift = JobRates(warmup=3), MemoryDrift()
    rng = np.random.default_rng(1)
    for k in range(12):
        judge(rates, drift, k, step_vectors(k, rng))
    model = JobModel(ModelConfig(warmup_windows=5))
    blob = model.to_bytes({"job_rate": rates.part(JOB), "drift": drift.part(JOB)})
    assert isinstance(JobModel.from_bytes(blob), JobModel)      # a tool that reads only the model
    # a part written by someone else (the state topic is writable by others): checked, one-line error
    forged = SimpleNamespace(state=lambda: ({"newest": "x", "known": True}, {}))
    with pytest.raises(CheckpointError, match="newest"):
        JobModel.from_bytes(model.to_bytes({"job_rate": forged}), {"job_rate": JobRates().part(JOB)})
    too_long = SimpleNamespace(state=lambda: ({"newest": 5, "known": True, "rate_in_change": 0, "ofu_in_change": 0},
                                              {"rate_history": np.ones(10**4), "ofu_history": np.ones(1)}))
    with pytest.raises(CheckpointError, match="rate_history"):
        JobModel.from_bytes(model.to_bytes({"job_rate": too_long}), {"job_rate": JobRates().part(JOB)})
