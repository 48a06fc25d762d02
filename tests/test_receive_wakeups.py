"""The rank behind a slow link wakes more per collective than its peers (streams/model/receive_wakeups.py).

Pure model tests on hand-made vectors; the worker's end-to-end use (a job slowed alike, the rank named and
diagnosed) is tests/test_scoring_stream.py::test_a_job_slowed_alike_by_a_slow_link_names_the_rank_behind_it.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from fleetscope.streams.model import JobModel, ModelConfig
from fleetscope.streams.model.receive_wakeups import SPAN, ReceiveWakeups, slow_receivers
from fleetscope.streams.model.state_archive import CheckpointError

JOB = ("acme", "train")


def vectors(per_call: list[float], calls: float = 4.0) -> list[dict]:
    return [{"proc_vol_ctx_per_s": p * calls, "nccl_calls_per_s": calls} for p in per_call]


def test_the_ratio_needs_a_full_span_and_sums_it_so_one_noisy_window_names_no_one():
    w = ReceiveWakeups()
    ranks = [0, 1, 2]
    for _ in range(SPAN - 1):
        assert w.step(JOB, ranks, vectors([60, 60, 60])) == [None, None, None]
    # rank 2 at 1.5x in one window of five: 66 per collective, its peers' median (60, 66) for each of them
    assert w.step(JOB, ranks, vectors([60, 60, 90])) == pytest.approx([60 / 63, 60 / 63, 66 / 60])
    assert slow_receivers(w.step(JOB, ranks, vectors([60, 60, 60]))) is None    # 1.1: under MIN_RATIO
    for _ in range(SPAN):
        ratios = w.step(JOB, ranks, vectors([65, 65, 85]))
    assert ratios == pytest.approx([65 / 75, 65 / 75, 85 / 65])   # each against the median of the other two
    assert slow_receivers(ratios) == [2]


def test_only_a_strict_minority_of_three_or_more_ranks_is_named():
    assert slow_receivers([1.0, 1.3, 1.3, 1.0]) is None         # half the ranks: no minority
    assert slow_receivers([1.0, 1.3]) is None                    # two ranks: one of two
    assert slow_receivers([1.0, 1.3, None, 1.0]) == [1]          # a rank without counts is not compared
    assert slow_receivers([1.0, 1.1, 1.0]) is None


def test_a_rank_without_wakeups_or_collectives_in_every_window_of_the_span_is_left_out():
    w = ReceiveWakeups()
    for i in range(SPAN):
        v = vectors([60, 60, 60, 90])
        if i == 2:
            del v[1]["proc_vol_ctx_per_s"]
        ratios = w.step(JOB, [0, 1, 2, 3], v)
    assert ratios[1] is None and ratios[3] == pytest.approx(1.5)
    gloo = [{"proc_vol_ctx_per_s": 300.0, "torch_collectives_per_s": 5.0} for _ in range(3)]
    w2 = ReceiveWakeups()
    for _ in range(SPAN):
        out = w2.step(JOB, [0, 1, 2], gloo)
    assert out == pytest.approx([1.0, 1.0, 1.0])      # gloo's collective rate counts as NCCL's does


def test_the_span_travels_in_the_jobs_checkpoint_and_a_forged_part_is_refused():
    w = ReceiveWakeups()
    for _ in range(SPAN - 1):
        w.step(JOB, [0, 1, 2], vectors([65, 65, 85]))
    w.step(("acme", "other"), [0, 1, 2], vectors([60, 60, 60]))
    blob = JobModel(ModelConfig(warmup_windows=5)).to_bytes({"receive_wakeups": w.part(JOB)})
    restored = ReceiveWakeups()
    JobModel.from_bytes(blob, {"receive_wakeups": restored.part(JOB)})
    assert list(restored.recent) == [JOB]
    # one window more names the rank at once, as the uninterrupted worker does
    assert restored.step(JOB, [0, 1, 2], vectors([65, 65, 85])) == w.step(JOB, [0, 1, 2], vectors([65, 65, 85]))
    assert slow_receivers(restored.step(JOB, [0, 1, 2], vectors([65, 65, 85]))) == [2]
    forged = SimpleNamespace(state=lambda: ({"windows": 1}, {"ranks": np.array([0], dtype=np.int64),
                                                             "wakeups": np.array([[-5.0]]),
                                                             "collectives": np.array([[4.0]])}))
    with pytest.raises(CheckpointError, match="out of range"):
        JobModel.from_bytes(JobModel(ModelConfig()).to_bytes({"receive_wakeups": forged}),
                            {"receive_wakeups": ReceiveWakeups().part(JOB)})
    too_long = SimpleNamespace(state=lambda: ({"windows": SPAN + 1}, {}))
    with pytest.raises(CheckpointError, match="windows"):
        JobModel.from_bytes(JobModel(ModelConfig()).to_bytes({"receive_wakeups": too_long}),
                            {"receive_wakeups": ReceiveWakeups().part(JOB)})
