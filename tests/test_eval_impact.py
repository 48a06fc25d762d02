"""Step rates from the workloads' progress files and each fault's measured impact; the bench's
pooled summary over repeats. Progress lines are written here in the workloads' own format
(the real workloads write them in tests/test_eval_workload.py)."""
from __future__ import annotations

import json

import pytest

from fleetscope.eval.impact import fault_impact, read_progress, window_rates


def progress(tmp_path, rank, points):
    with open(tmp_path / f"progress-rank{rank}.jsonl", "a") as f:
        for t, steps, pid in points:
            f.write(json.dumps({"t": t, "steps": steps, "pid": pid}) + "\n")


def test_rates_per_window_follow_the_curve_through_a_hang_and_a_restart(tmp_path):
    t0 = 1000.0
    # 10 steps/s for 4 s, stuck 4 s (a hang: no lines), 10 steps/s again; then a restart (new pid)
    pts = [(t0 + i * 0.5, 5 * i, 11) for i in range(9)]            # 0..4 s: 0..40 steps
    pts += [(t0 + 8 + i * 0.5, 40 + 5 * i, 11) for i in range(5)]  # 8..10 s: 40..60
    pts += [(t0 + 10.5 + i * 0.5, 5 + 5 * i, 12) for i in range(4)]  # new pid counts from 5
    progress(tmp_path, 0, pts)
    (tmp_path / "progress-rank0.jsonl").open("a").write('{"t": 10\n')  # a line cut short by a kill
    curves = read_progress(tmp_path)
    rates = window_rates(curves, t0, 2.0, 6)[0]
    assert rates[0] == pytest.approx(10.0) and rates[1] == pytest.approx(10.0)
    assert rates[2] == pytest.approx(0.0) and rates[3] == pytest.approx(0.0)
    assert curves[0][-1][1] == 60 + 20  # the restarted pid continues the count
    assert window_rates(curves, t0 - 10, 2.0, 2)[0] == [None, None]  # before the first point


def test_impact_is_measured_against_quiet_windows_and_small_changes_are_no_effect():
    rates = {0: [10.0, 10.2, 9.8, 10.0, 5.0, 5.1, 4.9, 10.0], 1: [10.0, 9.9, 10.1, 10.0, 10.0, 9.9, 10.0, 10.1]}
    m = fault_impact(rates, 1.0, [(3.0, 7.0)], (0,), quiet_before={0, 1, 2}, onset_windows=1)
    assert m["effect"] is True and m["impact_pct"] == pytest.approx(-50.0, abs=1.0)
    m = fault_impact(rates, 1.0, [(3.0, 7.0)], (1,), quiet_before={0, 1, 2}, onset_windows=1)
    assert m["effect"] is False and abs(m["impact_pct"]) < 5
    m = fault_impact(rates, 1.0, [(0.0, 4.0)], (0,), quiet_before=set(), onset_windows=1)
    assert m["effect"] is None and m["impact_pct"] is None  # nothing before it: not measured


def test_a_job_that_steps_faster_during_a_fault_shows_no_effect_not_one_to_detect():
    # the faults are inefficiencies: a rise of the step rate while one runs is not its impact
    rates = {0: [10.0, 10.2, 9.8, 10.0, 11.0, 11.1, 10.9, 10.0]}
    m = fault_impact(rates, 1.0, [(3.0, 7.0)], (0,), quiet_before={0, 1, 2}, onset_windows=1)
    assert m["impact_pct"] == pytest.approx(10.0, abs=1.0) and m["effect"] is False


def test_a_crash_is_measured_over_the_rest_of_the_run_not_its_one_second(tmp_path):
    from fleetscope.eval.runner import measure_impacts
    from fleetscope.eval.scenario import load_scenario
    path = tmp_path / "crash.yaml"
    path.write_text("name: crash\nworkload: ddp_cpu\nranks: 3\nduration_s: 20\nwindow_s: 1\nfaults:\n"
                    "  - {kind: crash, rank: 2, start_s: 10, duration_s: 1, expect: {kb_entry: crashed_rank, ranks: [2]}}\n")
    rates = {r: [10.0 + 0.1 * (k % 3) for k in range(10)] + [0.0] * 10 for r in range(3)}
    (m,) = measure_impacts(load_scenario(path), rates, 1.0, 20)
    # the windows after its onset grace to the end, not the empty [11, 11) of its one second
    assert m["effect"] is True and m["impact_pct"] == -100.0 and m["windows_during"] == 9


def _result(name, split, f1_tp, fp, healthy=False, repeat=0):
    from fleetscope.eval.scorer import Score
    s = Score(tp=f1_tp, fp=fp, fn=4 - f1_tp if not healthy else 0, tn=20, precision=None)
    tot = s.tp + s.fp
    s.precision = s.tp / tot if tot else None
    s.recall = s.tp / (s.tp + s.fn) if s.tp + s.fn else None
    s.f1 = (2 * s.precision * s.recall / (s.precision + s.recall)) if s.precision and s.recall else None
    s.false_positive_rate = fp / (fp + 20)
    if not healthy:
        s.job_tp, s.delays_windows, s.delays_s, s.detection_delay_windows = 1, [1], [2.0], 1
    return {"scenario": name, "file": f"benchmarks/scenarios/{split}/{name}.yaml", "repeat": repeat,
            "healthy": healthy, "faults": [] if healthy else [{"verdict": "scored"}],
            "impact_pct": [] if healthy else [-40.0 - repeat], "score": s.as_dict(), "score_lenient": s.as_dict()}


def test_pooled_summary_has_means_worst_repeats_and_splits(tmp_path):
    from fleetscope.cli.bench import merge_results, repeat_plan
    new = {"a": [_result("a", "dev", 4, 0), _result("a", "dev", 2, 0, repeat=1)],
           "h": [_result("h", "test", 0, 0, True), _result("h", "test", 0, 2, True, repeat=1)]}
    doc = merge_results(tmp_path / "scenarios.json", new)
    s = doc["summary"]
    assert s["strict"]["f1"] == pytest.approx((1.0 + 2 / 3) / 2) and s["strict"]["f1_worst"] == pytest.approx(2 / 3)
    assert s["healthy_flagged_frac"] == pytest.approx((0 + 2 / 22) / 2) and s["healthy_flagged_frac_worst"] == 1 / 11
    assert s["job"]["f1"] == 1.0 and s["median_delay_windows"] == 1 and s["p90_delay_s"] == 2.0
    assert set(s["by_split"]) == {"dev", "test"} and s["impact_pct"]["a"] == [-40.5]
    assert doc["scenarios"]["a"]["stats"]["f1"]["spread"] == pytest.approx(1 / 3)
    # a scenario run more often than the rest: its extra repeats stay in its own stats, out of the pools
    doc = merge_results(tmp_path / "scenarios.json", {"b": [_result("b", "dev", 4, 0, repeat=i) for i in range(3)]})
    s = doc["summary"]
    assert s["repeats_pooled"] == 2 and s["repeats_left_out"] == {"b": 1}   # a and h ran twice
    assert s["by_split"]["dev"]["repeats_left_out"] == {"b": 1} and s["by_split"]["test"]["repeats_left_out"] == {}
    assert doc["scenarios"]["b"]["stats"]["ran"] == 3
    plan = repeat_plan(3)
    assert len({p["seed"] for p in plan}) == 3 and len({p["start_offset_s"] for p in plan}) == 3
    assert [p["busy_loops"] for p in plan] == [0, 0, 1]
