"""The pure parts of the DDP overhead bench (fleetscope.eval.overhead): progress rates, paired ratios, the summary."""
from __future__ import annotations

import pytest

from fleetscope.eval.overhead import paired_ratios, rate_between, rotated, summarise


def test_rate_between_uses_the_first_and_last_progress_point_inside_the_window():
    points = [(9.5, 0), (10.2, 20), (11.2, 50), (12.2, 80), (13.4, 100)]
    rate, steps, span = rate_between(points, 10.0, 12.5)
    assert (steps, span) == (60, pytest.approx(2.0)) and rate == pytest.approx(30.0)
    assert rate_between(points, 10.0, 10.9) is None  # one point: no rate
    assert rate_between([], 0, 1) is None


def test_paired_ratios_divide_by_the_base_of_the_same_round_and_skip_rounds_without_it():
    rounds = [{"agent_off": 20.0, "full_tracing": 19.0}, {"full_tracing": 5.0},
              {"agent_off": 10.0, "full_tracing": 10.5, "sampling_only": None}]
    r = paired_ratios(rounds)
    assert r["agent_off"] == [1.0, 1.0]
    assert r["full_tracing"] == pytest.approx([0.95, 1.05])
    assert "sampling_only" not in r


def test_rotation_puts_each_setup_in_each_position_once():
    setups = ("a", "b", "c")
    orders = [rotated(setups, r) for r in range(3)]
    assert orders[0] == ["a", "b", "c"] and orders[1] == ["b", "c", "a"]
    assert all(sorted(o[i] for o in orders) == ["a", "b", "c"] for i in range(3))


def test_summary_takes_the_median_of_paired_ratios_and_judges_the_goal():
    def block(r, setup, rate, cpu, agent=None):
        b = {"round": r, "setup": setup, "steps_per_s": rate, "rank_cpu_ms_per_step": cpu}
        if agent is not None:
            b["agent"] = {"cpu_pct": agent}
        return b
    # the machine slows down in round 1: the rates drop, the paired ratios do not
    blocks = [block(0, "agent_off", 30.0, 10.0), block(0, "full_tracing", 29.7, 10.2, 5.0),
              block(1, "full_tracing", 19.0, 10.4, 6.0), block(1, "agent_off", 20.0, 10.0),
              block(2, "agent_off", 30.0, 10.0), block(2, "full_tracing", 29.4, 10.0, 4.0)]
    s = summarise(blocks)
    full = s["full_tracing"]
    assert full["ratio_to_agent_off_per_round"] == [0.99, 0.95, 0.98]
    assert full["ratio_to_agent_off"] == 0.98 and full["slowdown_pct"] == 2.0 and full["meets_goal"] is True
    assert full["steps_per_s_median"] == 29.4 and full["agent_cpu_pct_median"] == 5.0
    assert full["cpu_per_step_ratio_per_round"] == pytest.approx([0.9804, 0.9615, 1.0], abs=1e-4)
    assert s["agent_off"]["slowdown_pct"] == 0.0 and "meets_goal" not in s["agent_off"]
    assert summarise([block(0, "agent_off", 30.0, 10.0), block(0, "full_tracing", 29.0, 10.0, 5.0)]
                     )["full_tracing"]["meets_goal"] is False
