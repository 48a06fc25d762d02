"""The job against its own history (streams/model/job_rate.py) on the rank vectors a real run produced.

tests/recorded/dataloader_stall_rank_vectors_2.json.gz: the worker's rank vectors of a dev dataloader_stall run
(3 gloo ranks; rank 1 reads each batch from disk at 30-60 s, so the whole job runs at a quarter of its rate);
its collective rate is torch_collectives_per_s, from the always-on gloo marks."""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import SimpleNamespace

from fleetscope.streams.model.job_rate import JobRates

RECORDED = Path(__file__).parent / "recorded" / "dataloader_stall_rank_vectors_2.json.gz"


def test_a_job_slowed_by_its_stalled_rank_is_flagged_and_its_recovery_is_not():
    """The stall is a fall: flagged from its first windows until the slow rate is accepted as the job's regime
    (regime_windows). The job back at its old rate afterwards is faster than that regime, not slower: before
    only falls counted, the recovery was 19 windows of `job` flags on every rank."""
    doc = json.loads(gzip.open(RECORDED, "rt").read())
    rates = JobRates(warmup=15, regime_windows=20)
    flagged, named = {}, {}
    for w in doc["windows"]:
        k = round(w["t_s"])
        result = rates.step(("acme", "train"), round((1000 + w["t_s"]) * 1e9), [v for _, v in w["ranks"]])
        if result is not None:
            flagged[k] = result.flagged
            named[k] = result.rate_feature
    assert named[40] == "torch_collectives_per_s"
    assert sum(flagged.get(k, False) for k in range(31, 50)) >= 15
    after = [k for k in range(61, 91) if flagged.get(k)]
    assert not after, after
    assert not any(flagged.get(k) for k in range(0, 29))


def test_with_the_scorers_default_a_slowdown_stays_flagged_while_it_lasts():
    """The worker's job rates accept a slow rate as the job's normal only after slowdown_regime_windows: the
    whole 30 s stall is flagged, not its first 20 windows (regime_windows, as before: the alarm ended while the
    job still ran at a quarter of its rate), and the recovery still is not."""
    from fleetscope.streams.model import ModelConfig
    doc = json.loads(gzip.open(RECORDED, "rt").read())
    rates = JobRates(warmup=15, regime_windows=ModelConfig().slowdown_regime_windows)
    flagged = {}
    for w in doc["windows"]:
        result = rates.step(("acme", "train"), round((1000 + w["t_s"]) * 1e9), [v for _, v in w["ranks"]])
        if result is not None:
            flagged[round(w["t_s"])] = result.flagged
    stall = [k for k in range(31, 60) if k in flagged]
    assert sum(flagged[k] for k in stall) >= len(stall) - 2, [k for k in stall if not flagged[k]]
    assert sum(flagged.get(k, False) for k in range(52, 60)) >= 6     # past the old 20-window cut
    assert not [k for k in range(61, 91) if flagged.get(k)]
    assert rates.counts["regimes"] == 0


JOB_WIDE = Path(__file__).parent / "recorded" / "job_wide_slowdown_step_rates.json"


def job_wide_steps():
    """The job's collective rate per window of the recorded job-wide slowdown (3 ranks alike)."""
    doc = json.loads(JOB_WIDE.read_text())
    start, end = doc["fault_windows"]
    return [[{"torch_collectives_per_s": 2 * x}] * 3 for x in doc["steps_per_s"]], range(start, end)


def test_a_noisy_slowdown_keeps_its_alarm_while_its_windows_are_nearer_its_level_than_the_baseline():
    """Its healthy history holds a dip, so a median/MAD scale was wide and the slow windows read only -2.3..-4 deviations.
    Before the change kept its own level, the first of them under z_exit (3) ended the change at window 34 and
    the history learned the slow rate: 3 of 40 windows flagged (the whole-set run scored recall 0.01)."""
    steps, fault = job_wide_steps()
    rates = JobRates(warmup=15, regime_windows=300)
    flagged, z = {}, {}
    for k, vectors in enumerate(steps):
        result = rates.step(("acme", "train"), (1000 + k) * 10**9, vectors)
        flagged[k], z[k] = result.flagged, result.features.get("job_rate_z", 0.0)   # none in warm-up
    assert sum(flagged[k] for k in fault) >= len(fault) - 2, [k for k in fault if not flagged[k]]
    # with the median and MAD the dip widened the scale and some slow windows read above -3 (the exit deviations
    # alone would have ended the change there); the trimmed scale leaves the dip out of it
    assert all(z[k] <= -3 for k in fault), {k: round(z[k], 1) for k in fault if z[k] > -3}
    assert not [k for k in flagged if flagged[k] and k not in fault]


def test_a_worker_restored_in_the_middle_of_a_slowdown_keeps_its_level():
    """The change's level travels in the checkpoint; one saved before it existed loads and falls back to the
    exit deviations alone."""
    from fleetscope.streams.model import JobModel, ModelConfig
    steps, fault = job_wide_steps()
    whole, first = JobRates(warmup=15, regime_windows=300), JobRates(warmup=15, regime_windows=300)
    job = ("acme", "train")
    for k in range(36):
        whole.step(job, (1000 + k) * 10**9, steps[k])
        first.step(job, (1000 + k) * 10**9, steps[k])
    model = JobModel(ModelConfig(warmup_windows=5))
    restored = JobRates(warmup=15, regime_windows=300)
    JobModel.from_bytes(model.to_bytes({"job_rate": first.part(job)}), {"job_rate": restored.part(job)})
    for k in range(36, len(steps)):
        assert restored.step(job, (1000 + k) * 10**9, steps[k]) == whole.step(job, (1000 + k) * 10**9, steps[k])

    meta, arrays = first.state(job)
    older = {k: v for k, v in meta.items() if not k.endswith("_change_sum")}
    legacy = JobRates(warmup=15, regime_windows=300)
    saved = SimpleNamespace(state=lambda: (older, arrays))
    JobModel.from_bytes(model.to_bytes({"job_rate": saved}), {"job_rate": legacy.part(job)})
    assert legacy.jobs[job].rate.change_sum is None and legacy.jobs[job].rate.in_change
    assert legacy.step(job, 1036 * 10**9, steps[36]) is not None


def test_a_job_ofu_regression_keeps_its_alarm_through_its_shallower_windows():
    """The job's OFU uses the same change level (synthetic series: healthy 26-34, a fall entered at 11, then
    15-17 with windows at 22, 2.7 deviations down). Before, the first window at 22 ended the change and the
    history learned the regression: 4 of its 12 windows flagged."""
    healthy = [30, 33, 27, 34, 26, 30, 32, 28, 31, 29] * 3
    regression = [11, 16, 17, 15, 22, 16, 22, 15, 17, 22, 16, 15]
    rates = JobRates(warmup=10)
    flagged = [rates.step(("acme", "train"), (1000 + k) * 10**9, [{"job_gpu_ofu": float(x)}] * 2).ofu_flagged
               for k, x in enumerate(healthy + regression + [30, 29, 31, 30])]
    assert flagged[30:42] == [True] * 12
    assert not any(flagged[:30]) and not any(flagged[42:])


SLOW_LINK = Path(__file__).parent / "recorded" / "slow_link_job_calls.json"


def test_a_job_of_few_collectives_a_window_is_judged_on_its_mean_not_on_whichever_count_holds_the_median():
    """The recorded dev slow_link run: 7 or 8 collectives a window, 3 or 4 while the link is slow (iterations
    ~1.9 times as long). Its median landed on 7 with a MAD of 1, and the slowdown read -2.0 deviations: no
    window flagged. On the trimmed mean (7.5, deviation 0.5) every window of the fault reads about -7."""
    doc = json.loads(SLOW_LINK.read_text())
    start, end = doc["fault_windows"]
    rates = JobRates(warmup=15, regime_windows=300)
    flagged = {}
    for k, calls in enumerate(doc["calls_per_s"]):
        result = rates.step(("acme", "train"), (1000 + k) * 10**9, [{"nccl_calls_per_s": c} for c in calls])
        if result is not None:
            flagged[k] = result
    fault = range(start, end)
    assert all(flagged[k].flagged for k in fault), [k for k in fault if not flagged[k].flagged]
    assert not [k for k, r in flagged.items() if r.flagged and k not in fault]
    assert all(flagged[k].features["job_iteration_time_ratio"] > 1.7 for k in fault)
