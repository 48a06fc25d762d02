"""Scorer on hand-made ground truth: exact precision, recall, F1, delay, FPR and KB match."""
from __future__ import annotations

import importlib.util

import pytest

from fleetscope.eval.plot import PlotUnavailable, plot_scores
from fleetscope.eval.scorer import Diagnosis, Truth, WindowResult, label, score_run, summarize, window_index

# 2 ranks, 10 windows of 2 s; the fault hits rank 1 from 7 s to 13 s:
# windows 3 [6,8), 4, 5 [10,12), 6 [12,14) overlap it -> 4 positives on rank 1.
FAULT = Truth(ranks=(0, 1), duration_s=20, window_s=2, fault_start_s=7, fault_end_s=13,
              faulty_ranks=frozenset({1}), kb_entry="straggler_rank")
HEALTHY = Truth(ranks=(0, 1), duration_s=20, window_s=2)


def flags(truth: Truth, flagged: set[tuple[int, int]]) -> list[WindowResult]:
    return [WindowResult(r, k, (r, k) in flagged, score=float((r, k) in flagged), threshold=0.5)
            for r in truth.ranks for k in range(truth.n_windows)]


def test_labels_of_the_grid():
    assert [label(FAULT, 1, k) for k in range(10)] == ["negative"] * 3 + ["positive"] * 4 + ["negative"] * 3
    assert all(label(FAULT, 0, k) == "negative" for k in range(10))
    # 1.5 s onset grace: window 3 [6,8) overlaps only [7, 8.5) -> ignored; window 4 [8,10) overlaps [8.5,13)
    assert [label(FAULT, 1, k, onset_grace_s=1.5) for k in (3, 4)] == ["ignored", "positive"]
    assert label(FAULT, 1, 7, recovery_grace_s=2) == "ignored"  # [14,16) within [13,15)
    assert label(FAULT, 0, 5, ignore_peers_during_fault=True) == "ignored"
    assert window_index(7.0, 2) == 3 and window_index(6.0, 2) == 3 and window_index(5.999, 2) == 2


def test_perfect_detection():
    s = score_run(FAULT, flags(FAULT, {(1, 3), (1, 4), (1, 5), (1, 6)}))
    assert (s.tp, s.fp, s.fn, s.tn, s.ignored, s.missing_windows) == (4, 0, 0, 16, 0, 0)
    assert s.precision == 1.0 and s.recall == 1.0 and s.f1 == 1.0 and s.false_positive_rate == 0.0
    assert s.detection_delay_windows == 0 and s.detection_delay_s == 1.0  # window 3 ends at 8 s


def test_late_partial_detection_with_a_false_positive_on_the_peer():
    # rank 1 flagged in windows 5 and 6 (2 of 4), rank 0 flagged in window 5, rank 1 flagged once before the fault
    s = score_run(FAULT, flags(FAULT, {(1, 5), (1, 6), (0, 5), (1, 1)}))
    assert (s.tp, s.fp, s.fn, s.tn) == (2, 2, 2, 14)
    assert s.precision == 0.5 and s.recall == 0.5 and s.f1 == 0.5
    assert s.false_positive_rate == 2 / 16
    assert s.detection_delay_windows == 2 and s.detection_delay_s == 5.0  # window 5 ends at 12 s; fault at 7 s
    # the same run, peers ignored during the fault and 1 s of onset grace: positives are windows
    # 4-6 (overlapping [8, 13)); rank 1's window 3 and rank 0's windows 3-6 are ignored
    g = score_run(FAULT, flags(FAULT, {(1, 5), (1, 6), (0, 5), (1, 1)}), onset_grace_s=1.0,
                  ignore_peers_during_fault=True)
    assert (g.tp, g.fp, g.fn, g.tn, g.ignored) == (2, 1, 1, 11, 5)
    assert g.precision == 2 / 3 and g.recall == 2 / 3 and g.f1 == pytest.approx(2 / 3)


def test_missed_fault_and_missing_windows():
    results = [r for r in flags(FAULT, set()) if r.window != 9] + [WindowResult(5, 0, True), WindowResult(0, 99, True)]
    s = score_run(FAULT, results)
    assert (s.tp, s.fp, s.fn, s.tn) == (0, 0, 4, 16)
    assert s.missing_windows == 2 and s.unknown_windows == 2  # window 9 of both ranks; rank 5, window 99
    assert s.precision is None and s.recall == 0.0 and s.f1 is None
    assert s.detection_delay_windows is None and s.detection_delay_s is None


def test_healthy_run_false_positive_rate():
    s = score_run(HEALTHY, flags(HEALTHY, {(0, 2)}))
    assert (s.tp, s.fp, s.fn, s.tn) == (0, 1, 0, 19)
    assert s.false_positive_rate == 1 / 20 and s.precision == 0.0 and s.recall is None and s.f1 is None
    assert s.detection_delay_windows is None and s.kb_match is None


def test_kb_entry_matched_by_the_most_frequent_top_diagnosis_on_the_faulty_rank():
    diags = [
        Diagnosis(1, 3, "cpu_contention_noisy_neighbour", 0.6), Diagnosis(1, 3, "straggler_rank", 0.9),
        Diagnosis(1, 4, "straggler_rank", 0.8),
        Diagnosis(1, 5, "python_gc_storm", 0.7),
        Diagnosis(0, 5, "python_gc_storm", 0.99),  # a non-faulty rank: not a vote
        Diagnosis(1, 8, "python_gc_storm", 0.99),  # after the fault: not a vote
    ]
    s = score_run(FAULT, flags(FAULT, {(1, 3)}), diags)
    assert s.kb_votes == {"straggler_rank": 2, "python_gc_storm": 1}
    assert s.top_kb_entry == "straggler_rank" and s.kb_match is True
    tie = score_run(FAULT, [], [Diagnosis(1, 4, "python_gc_storm"), Diagnosis(1, 5, "straggler_rank")])
    assert tie.top_kb_entry == "python_gc_storm" and tie.kb_match is False  # ties: the earliest window wins
    assert score_run(FAULT, []).kb_match is False and score_run(FAULT, []).top_kb_entry is None


def test_summary_over_scenarios():
    a = score_run(FAULT, flags(FAULT, {(1, 3), (1, 4), (1, 5), (1, 6)}))  # delay 0
    b = score_run(FAULT, flags(FAULT, {(1, 5), (1, 6), (0, 5), (1, 1)}))  # delay 2
    c = score_run(FAULT, flags(FAULT, set()))  # missed
    h = score_run(HEALTHY, flags(HEALTHY, {(0, 2)}))
    out = summarize({"a": a, "b": b, "c": c, "healthy": h}, healthy={"healthy"})
    assert out["precision"] == 6 / 8 and out["recall"] == 6 / 12
    assert out["f1"] == pytest.approx(2 * 0.75 * 0.5 / 1.25)
    assert out["median_delay_windows"] == 1 and out["undetected"] == ["c"]
    assert out["healthy_flagged_frac"] == 1 / 20


def test_truth_rejects_inconsistent_ground_truth():
    with pytest.raises(ValueError, match="before"):
        Truth(ranks=(0,), duration_s=10, window_s=1, fault_start_s=5, fault_end_s=5)
    with pytest.raises(ValueError, match="not all in ranks"):
        Truth(ranks=(0,), duration_s=10, window_s=1, fault_start_s=1, fault_end_s=2, faulty_ranks=frozenset({3}))
    with pytest.raises(ValueError, match="neither"):
        Truth(ranks=(0,), duration_s=10, window_s=1, fault_start_s=1)


HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed; the plot is optional")
def test_plot_writes_a_png(tmp_path):
    out = plot_scores(FAULT, flags(FAULT, {(1, 4)}), tmp_path / "plots" / "run.png", title="straggler")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(HAVE_MPL, reason="matplotlib is installed")
def test_plot_without_matplotlib_says_what_to_install(tmp_path):
    with pytest.raises(PlotUnavailable, match="needs matplotlib"):
        plot_scores(FAULT, [], tmp_path / "run.png")


# Scenario files: the ground truth the scorer gets.
SCENARIOS = __import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks" / "scenarios"


def test_shipped_scenarios_load_and_their_faults_can_be_built(tmp_path):
    from fleetscope.eval.faults import make_fault
    from fleetscope.eval.relay import DelayRelay
    from fleetscope.eval.scenario import load_scenarios
    scenarios = {s.name: s for s in load_scenarios([SCENARIOS])}
    assert {"healthy", "straggler_cpu_quota", "straggler_competing_load", "slow_collective_one_rank",
            "memcpy_stall", "gpu_memory_leak", "python_gc_storm", "dataloader_stall", "network_degradation",
            "memory_pressure", "irq_storm"} <= set(scenarios)
    for s in scenarios.values():
        f = s.fault
        fault = make_fault(f.kind, pid=1, rank=f.rank, strength=f.strength, params=f.params, control_dir=tmp_path,
                           relay=DelayRelay(("127.0.0.1", 1)))  # built, not started
        assert fault.kind == f.kind, s.name
    t = scenarios["straggler_cpu_quota"].truth()
    assert (t.fault_start_s, t.fault_end_s, t.faulty_ranks, t.kb_entry, t.n_windows) == (30, 60, {1}, "straggler_rank", 45)
    assert scenarios["healthy"].truth().healthy
    assert t.ignore_peers and not t.effect_persists  # the defaults
    assert scenarios["gpu_memory_leak"].truth().effect_persists


def test_truth_can_ignore_peers_and_what_outlasts_the_fault():
    from dataclasses import replace
    t = replace(FAULT, ignore_peers=True, effect_persists=True)
    assert [label(t, 0, k) for k in (2, 3, 6, 7)] == ["negative", "ignored", "ignored", "negative"]
    assert [label(t, 1, k) for k in (2, 3, 6, 7, 9)] == ["negative", "positive", "positive", "ignored", "ignored"]
    # the run of test_late_partial_detection: rank 0's flag in window 5 and no more after-fault negatives
    s = score_run(t, flags(t, {(1, 5), (1, 6), (0, 5), (1, 1), (1, 8)}))
    assert (s.tp, s.fp, s.fn, s.tn, s.ignored) == (2, 1, 2, 8, 7)


@pytest.mark.parametrize("edit, message", [
    (("fault", "rank", 5), "fault.rank: 5 is not a rank of this 3-rank job"),
    (("fault", "kind", "netem"), "fault.kind: 'netem' is not one of"),
    (("fault", "duration_s", 80), "fault.duration_s: 80 is not positive and ending by the run's duration_s"),
    (("expect", "kb_entry", "gremlins"), "expect.kb_entry: 'gremlins' is not null or a KB entry"),
    (("fault", "strength", "high"), "fault.strength: must be in (0, 1], got 'high'"),
    ((None, "window", 2), "window: unknown field"),
    ((None, "ranks", None), "ranks: must be"),
    (("expect", "peers", "maybe"), "expect.peers: 'maybe' is not ignored (the default"),
    (("expect", "persists", "yes"), "expect.persists: must be true or false"),
])
def test_scenario_errors_name_the_file_and_field(tmp_path, edit, message):
    import yaml
    from fleetscope.eval.scenario import ScenarioError, load_scenario
    data = yaml.safe_load((SCENARIOS / "straggler_cpu_quota.yaml").read_text())
    section, key, value = edit
    (data[section] if section else data)[key] = value
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ScenarioError) as e:
        load_scenario(bad)
    assert str(e.value).startswith(f"{bad}: ") and message in str(e.value), str(e.value)
