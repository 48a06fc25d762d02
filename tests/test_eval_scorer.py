"""Scorer on hand-made ground truth: exact precision, recall, F1, delay, FPR, KB match, job-level
incidents, roles and multi-fault truth. The flags are hand-made on purpose: the scorer's
arithmetic is what is under test, not the detector."""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace

import pytest

from fleetscope.eval.plot import PlotUnavailable, plot_scores
from fleetscope.eval.scorer import (Diagnosis, FaultTruth, Score, Truth, WindowResult, label, score_run, summarize,
                                    window_index)

# 2 ranks, 10 windows of 2 s; the fault hits rank 1 from 7 s to 13 s:
# windows 3 [6,8), 4, 5 [10,12), 6 [12,14) overlap it -> 4 positives on rank 1.
STRAGGLER = FaultTruth(intervals=((7, 13),), culprits=frozenset({1}), kb_entry="straggler_rank")
FAULT = Truth(ranks=(0, 1), duration_s=20, window_s=2, faults=(STRAGGLER,))
HEALTHY = Truth(ranks=(0, 1), duration_s=20, window_s=2)


def flags(truth: Truth, flagged: set[tuple[int, int]], roles: dict | None = None) -> list[WindowResult]:
    return [WindowResult(r, k, (r, k) in flagged, score=float((r, k) in flagged), threshold=0.5,
                         role=(roles or {}).get((r, k)))
            for r in truth.ranks for k in range(truth.n_windows)]


def test_labels_of_the_grid():
    assert [label(FAULT, 1, k) for k in range(10)] == ["negative"] * 3 + ["positive"] * 4 + ["negative"] * 3
    assert all(label(FAULT, 0, k) == "negative" for k in range(10))  # strict: a peer is never excused
    # 1.5 s onset grace: window 3 [6,8) overlaps only [7, 8.5) -> ignored; window 4 [8,10) overlaps [8.5,13)
    assert [label(FAULT, 1, k, onset_grace_s=1.5) for k in (3, 4)] == ["ignored", "positive"]
    assert label(FAULT, 1, 7, recovery_grace_s=2) == "ignored"  # [14,16) within [13,15)
    assert label(FAULT, 0, 5, lenient=True) == "ignored"
    assert window_index(7.0, 2) == 3 and window_index(6.0, 2) == 3 and window_index(5.999, 2) == 2


def test_an_instant_fault_is_positive_in_the_window_it_happens_in_and_ignored_after():
    """A crash at 40 s on rank 2 (1 s windows): window 40 is its own; with the usual 1 s onset grace it would be
    ignored, and every positive after it would lie where a dead rank sends nothing."""
    crash = FaultTruth(intervals=((40, 41),), culprits=frozenset({2}), persists=True, instant=True)
    truth = Truth(ranks=(0, 1, 2), duration_s=60, window_s=1, faults=(crash,))
    assert [label(truth, 2, k, onset_grace_s=1, recovery_grace_s=2) for k in (39, 40, 41, 59)] == \
        ["negative", "positive", "ignored", "ignored"]
    assert label(truth, 0, 40, onset_grace_s=1) == "negative"
    state = replace(crash, instant=False)   # the same interval as a state: its only window is onset grace
    assert label(replace(truth, faults=(state,)), 2, 40, onset_grace_s=1) == "ignored"
    s = score_run(truth, flags(truth, {(2, 40)}), onset_grace_s=1, recovery_grace_s=2)
    assert (s.tp, s.fn, s.fp, s.recall, s.detection_delay_windows) == (1, 0, 0, 1.0, 0)


def test_perfect_detection():
    s = score_run(FAULT, flags(FAULT, {(1, 3), (1, 4), (1, 5), (1, 6)}),
                  [Diagnosis(1, k, "straggler_rank") for k in range(3, 7)])
    assert (s.tp, s.fp, s.fn, s.tn) == (4, 0, 0, 16)
    assert s.f1 == 1.0 and s.detection_delay_windows == 0 and s.detection_delay_s == 1.0  # window 3 ends at 8
    assert s.kb_match is True and (s.job_tp, s.job_fn, s.job_fp, s.job_f1) == (1, 0, 0, 1.0)


def test_a_waiting_peer_is_a_false_positive_unless_labelled_waiting():
    run = {(1, 3), (1, 4), (1, 5), (1, 6), (0, 4), (0, 5)}
    s = score_run(FAULT, flags(FAULT, run))
    assert (s.tp, s.fp, s.precision) == (4, 2, 4 / 6)
    s = score_run(FAULT, flags(FAULT, run, roles={(0, 4): "waiting", (0, 5): "waiting"}))
    assert (s.tp, s.fp, s.precision, s.waiting_windows) == (4, 0, 1.0, 2)
    # a culprit rank labelled waiting is not a culprit flag: a miss there
    s = score_run(FAULT, flags(FAULT, run, roles={(1, 3): "waiting"}))
    assert (s.tp, s.fn, s.fp) == (3, 1, 2)
    # roles other than waiting still count as flags
    s = score_run(FAULT, flags(FAULT, run, roles={(0, 4): "culprit", (0, 5): "node"}))
    assert s.fp == 2


def test_late_partial_detection_with_a_false_positive_and_a_false_incident():
    s = score_run(FAULT, flags(FAULT, {(1, 5), (1, 6), (0, 5), (1, 1), (1, 8)}))
    assert (s.tp, s.fp, s.fn, s.tn) == (2, 3, 2, 13)
    assert s.precision == 0.4 and s.recall == 0.5 and s.detection_delay_windows == 2
    assert s.detection_delay_s == 5.0  # window 5 ends at 12; the fault began at 7
    # windows 1 and 8 are outside the fault: two separate false incidents; the fault was found
    assert (s.job_tp, s.job_fp, s.job_fn) == (1, 2, 0)
    assert s.false_positive_rate == 3 / 16


def test_missed_fault_and_missing_windows():
    s = score_run(FAULT, [WindowResult(0, k, False) for k in range(10)])
    assert (s.tp, s.fn, s.missing_windows) == (0, 4, 10)
    assert s.recall == 0.0 and s.precision is None and s.f1 is None and s.detection_delay_windows is None
    assert (s.job_tp, s.job_fn, s.job_recall) == (0, 1, 0.0)


def test_healthy_run_false_positive_rate():
    s = score_run(HEALTHY, flags(HEALTHY, {(0, 2), (1, 2), (1, 3)}))
    assert (s.fp, s.tn, s.false_positive_rate) == (3, 17, 0.15)
    assert s.job_fp == 1  # windows 2 and 3 are one false incident
    assert s.kb_match is None and s.detection_delay_windows is None


def test_kb_entry_matched_by_the_most_frequent_top_diagnosis_on_the_culprit():
    diags = [Diagnosis(1, 3, "cpu_contention_noisy_neighbour", 0.9), Diagnosis(1, 3, "straggler_rank", 0.5),
             Diagnosis(1, 4, "straggler_rank", 0.8), Diagnosis(1, 5, "straggler_rank", 0.8),
             Diagnosis(0, 5, "python_gc_storm", 1.0),   # not a culprit: not counted
             Diagnosis(1, 8, "python_gc_storm", 1.0)]   # after the fault: not counted
    s = score_run(FAULT, flags(FAULT, {(1, 3)}), diags)
    assert s.top_kb_entry == "straggler_rank" and s.kb_match is True
    assert s.kb_votes == {"cpu_contention_noisy_neighbour": 1, "straggler_rank": 2}
    s = score_run(FAULT, flags(FAULT, set()), [Diagnosis(1, 4, "python_gc_storm")])
    assert s.kb_match is False and (s.kb_faults, s.kb_hits) == (1, 0)


def test_periodic_bursts_are_separate_incidents_with_their_own_delays():
    bursts = FaultTruth(intervals=((2, 6), (12, 16)), culprits=frozenset({1}))
    t = Truth(ranks=(0, 1), duration_s=20, window_s=2, faults=(bursts,))
    assert [label(t, 1, k) for k in range(10)] == (["negative"] + ["positive"] * 2 + ["negative"] * 3
                                                   + ["positive"] * 2 + ["negative"] * 2)
    s = score_run(t, flags(t, {(1, 1), (1, 7)}), recovery_grace_s=0.0)
    assert s.faults[0].incidents == 2 and s.faults[0].found == 2
    assert s.delays_windows == [0, 1] and s.delays_s == [2.0, 4.0]
    s = score_run(t, flags(t, {(1, 1)}))
    assert (s.job_tp, s.job_fn) == (1, 1)


def test_two_overlapping_faults_each_scored_on_its_own_culprit():
    a = FaultTruth(intervals=((2, 10),), culprits=frozenset({1}), kb_entry="straggler_rank", name="a")
    b = FaultTruth(intervals=((6, 14),), culprits=frozenset({2}), kb_entry="python_gc_storm", name="b")
    t = Truth(ranks=(0, 1, 2), duration_s=20, window_s=2, faults=(a, b))
    assert [label(t, 2, k) for k in (2, 3, 6, 7)] == ["negative", "positive", "positive", "negative"]
    s = score_run(t, flags(t, {(1, 1), (1, 2), (1, 3), (1, 4), (2, 4), (0, 4)}),
                  [Diagnosis(1, 2, "straggler_rank"), Diagnosis(2, 4, "straggler_rank")])
    fa, fb = s.faults
    assert (fa.tp, fa.fn, fa.kb_match) == (4, 0, True)
    assert (fb.tp, fb.fn, fb.kb_match) == (1, 3, False)
    assert s.fp == 1 and s.kb_match is False and (s.kb_faults, s.kb_hits) == (2, 1)


def test_job_and_node_scope_make_every_rank_a_culprit_and_unscored_faults_are_ignored():
    job = FaultTruth(intervals=((4, 12),), culprits=frozenset({0, 1}), scope="job")
    t = Truth(ranks=(0, 1), duration_s=20, window_s=2, faults=(job,))
    assert label(t, 0, 3) == label(t, 1, 3) == "positive"
    noop = replace(job, scored=False)
    t = Truth(ranks=(0, 1), duration_s=20, window_s=2, faults=(noop,))
    s = score_run(t, flags(t, {(0, 3), (1, 8)}))
    assert label(t, 0, 3) == "ignored" and (s.tp, s.fn, s.fp) == (0, 0, 1)  # window 8 is a real negative
    assert s.faults[0].scored is False and (s.job_tp, s.job_fn) == (0, 0)


def test_persisting_effect_ignores_what_follows_on_the_culprit_only():
    t = Truth(ranks=(0, 1), duration_s=20, window_s=2, faults=(replace(STRAGGLER, persists=True),))
    assert [label(t, 1, k) for k in (2, 3, 6, 7, 9)] == ["negative", "positive", "positive", "ignored", "ignored"]
    assert label(t, 0, 9) == "negative"


def test_summary_over_scenarios_pools_windows_incidents_and_delays():
    a = score_run(FAULT, flags(FAULT, {(1, 3), (1, 4), (1, 5), (1, 6)}), [Diagnosis(1, 4, "straggler_rank")])
    b = score_run(FAULT, flags(FAULT, {(1, 5), (0, 5)}))
    h = score_run(HEALTHY, flags(HEALTHY, {(0, 1)}))
    out = summarize({"a": a, "b": b, "h": h}, healthy={"h"})
    assert out["precision"] == 5 / 6 and out["recall"] == 5 / 8
    assert out["median_delay_windows"] == 1.0 and out["p90_delay_s"] == 5.0
    assert out["healthy_flagged_frac"] == 1 / 20 and out["kb_hit_rate"] == 0.5
    assert out["job"]["found"] == 2 and out["job"]["false_incidents"] == 1
    # a Score survives the trip through the result JSON
    assert Score.from_dict(a.as_dict()) == a


def test_truth_rejects_inconsistent_ground_truth():
    with pytest.raises(ValueError, match="culprit ranks"):
        Truth(ranks=(0, 1), duration_s=20, window_s=2, faults=(replace(STRAGGLER, culprits=frozenset({2})),))
    with pytest.raises(ValueError, match="must be before"):
        FaultTruth(intervals=((5, 5),), culprits=frozenset({0}))
    with pytest.raises(ValueError, match="at least one culprit"):
        FaultTruth(intervals=((1, 5),), culprits=frozenset())
    with pytest.raises(ValueError, match="must be > 0"):
        Truth(ranks=(0,), duration_s=20, window_s=0)


HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed; the plot is optional")
def test_plot_writes_a_png(tmp_path):
    out = plot_scores(FAULT, flags(FAULT, {(1, 4)}, roles={(1, 4): "waiting"}), tmp_path / "plots" / "run.png",
                      title="straggler", rates={0: [10.0] * 10, 1: [10.0, None] + [5.0] * 8})
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails, installed or not
    with pytest.raises(PlotUnavailable, match="needs matplotlib"):
        plot_scores(FAULT, [], tmp_path / "run.png")


# Scenario files: the ground truth the scorer gets.
SCENARIOS = __import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks" / "scenarios"


def test_shipped_scenarios_load_split_and_their_faults_can_be_built(tmp_path):
    from fleetscope.eval.faults import make_fault
    from fleetscope.eval.nvml_standin import NvmlStandin
    from fleetscope.eval.relay import DelayRelay
    from fleetscope.eval.scenario import load_scenarios
    dev = {s.name: s for s in load_scenarios([SCENARIOS / "dev"])}
    test = {s.name: s for s in load_scenarios([SCENARIOS / "test"])}
    assert len(dev) + len(test) >= 20 and not set(dev) & set(test)
    scenarios = {**dev, **test}
    kinds = {f.kind for s in scenarios.values() for f in s.faults}
    assert {"hang", "crash", "irq_affinity", "thp_off", "gpu_throttle", "cpu_quota", "gc_storm", "gpu_xid"} <= kinds
    assert any(len(s.faults) >= 2 for s in scenarios.values())
    assert any(f.schedule.times > 1 for s in scenarios.values() for f in s.faults)
    assert any(f.target == "outside" for s in scenarios.values() for f in s.faults)
    assert any(f.target == "all" for s in scenarios.values() for f in s.faults)
    assert any(s.events for s in scenarios.values()) and any(s.phases for s in scenarios.values())
    assert any(s.rank_args for s in scenarios.values() if s.healthy)
    for s in scenarios.values():
        assert s.window_s == 1 and s.duration_s <= 150, s.name
        # as the runner builds them: with the run's NVML stand-in where the scenario loads one (not built here)
        nvml = NvmlStandin(tmp_path / "nvml", gpus=s.ranks) if "nvml_standin" in s.requires else None
        for f in s.faults:
            targets = [None] if f.target == "outside" or f.kind == "thp_off" else list(f.ranks)
            for r in targets:
                fault = make_fault(f.kind, pid=1, rank=r, strength=f.strength, params=f.params, control_dir=tmp_path,
                                   relay=DelayRelay(("127.0.0.1", 1)), outside=f.target == "outside",
                                   nvml=nvml)  # not started
                assert fault.kind == f.kind, s.name
    t = scenarios["straggler_cpu_quota"].truth()
    f = t.faults[0]
    assert (f.intervals, f.culprits, f.kb_entry, t.n_windows) == (((30, 60),), {1}, "straggler_rank", 90)
    assert scenarios["healthy"].truth().healthy
    assert scenarios["gpu_memory_leak"].truth().faults[0].persists
    crash = scenarios["crash_one_rank"].truth().faults[0]
    assert crash.persists and crash.instant  # a crash persists by default, and is an event: no onset grace
