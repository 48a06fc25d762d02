"""The scenario format: faults as a list with targets, schedules and their own expectations,
workload events, phases and per-rank arguments; the old single-fault form; errors that name
the file and the field."""
from __future__ import annotations

import pytest
import yaml

from fleetscope.eval.scenario import ScenarioError, load_scenario

BASE = {"name": "x", "workload": "ddp_cpu", "ranks": 3, "duration_s": 100, "window_s": 1,
        "faults": [{"kind": "cpu_quota", "rank": 1, "start_s": 20, "duration_s": 10, "strength": 0.8,
                    "expect": {"kb_entry": "straggler_rank", "ranks": [1]}}]}


def write(tmp_path, data, name="s.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def with_fault(**over):
    return {**BASE, "faults": [{**BASE["faults"][0], **over}]}


def test_one_rank_fault_and_its_truth(tmp_path):
    s = load_scenario(write(tmp_path, BASE))
    f = s.faults[0]
    assert (f.target, f.ranks, f.schedule.intervals(), f.expect.scope, f.scorable) == \
        ("ranks", (1,), [(20, 30)], "rank", True)
    t = s.truth()
    assert t.faults[0].culprits == {1} and t.faults[0].intervals == ((20, 30),) and not t.healthy


def test_periodic_schedule_gives_every_burst(tmp_path):
    s = load_scenario(write(tmp_path, with_fault(every_s=25, times=3)))
    assert s.faults[0].schedule.intervals() == [(20, 30), (45, 55), (70, 80)]


@pytest.mark.parametrize("target, ranks, culprits, scope", [
    ({"ranks": [0, 2]}, (0, 2), (0, 2), "rank"),
    ({"target": "all"}, (0, 1, 2), (0, 1, 2), "job"),
])
def test_targets(tmp_path, target, ranks, culprits, scope):
    f = {k: v for k, v in BASE["faults"][0].items() if k not in ("rank", "expect")}
    s = load_scenario(write(tmp_path, {**BASE, "faults": [{**f, **target, "expect": {"kb_entry": None}}]}))
    assert (s.faults[0].ranks, s.faults[0].expect.ranks, s.faults[0].expect.scope) == (ranks, culprits, scope)


def test_outside_target_is_a_node_fault_on_every_rank(tmp_path):
    f = {"kind": "competing_load", "target": "outside", "start_s": 5, "duration_s": 5, "params": {"hogs": 2},
         "expect": {"kb_entry": "cpu_contention_noisy_neighbour"}}
    s = load_scenario(write(tmp_path, {**BASE, "faults": [f]}))
    assert (s.faults[0].ranks, s.faults[0].expect.ranks, s.faults[0].expect.scope) == ((), (0, 1, 2), "node")


def test_events_phases_rank_args_and_warmup(tmp_path):
    data = {**BASE, "faults": [], "events": [{"kind": "restart", "at_s": 50}], "warmup_windows": 10,
            "phases": {"eval": {"every_steps": 100, "steps": 20}, "checkpoint": {"every_steps": 300, "mb": 32}},
            "rank_args": {2: {"batch": 128, "threads": 2}}}
    s = load_scenario(write(tmp_path, data))
    assert s.healthy and s.truth().healthy
    assert [(e.kind, e.at_s) for e in s.events] == [("restart", 50.0)]
    assert s.phases == {"eval": {"every_steps": 100, "steps": 20}, "checkpoint": {"every_steps": 300, "mb": 32}}
    assert s.rank_args == {2: {"batch": 128, "threads": 2}} and s.warmup_windows == 10


def test_crash_persists_and_link_delay_on_gloo_is_never_scored(tmp_path):
    s = load_scenario(write(tmp_path, with_fault(kind="crash", strength=1.0)))
    assert s.faults[0].expect.persists
    s = load_scenario(write(tmp_path, with_fault(kind="link_delay")))
    assert not s.faults[0].scorable and "netem" in s.faults[0].unscored
    assert s.truth().faults[0].scored is False
    # a fault the run measured no effect of is not scored either
    s = load_scenario(write(tmp_path, BASE))
    assert s.truth({0: False}).faults[0].scored is False and s.truth({0: None}).faults[0].scored is True


def test_old_single_fault_form_still_loads(tmp_path):
    old = {k: v for k, v in BASE.items() if k != "faults"}
    old["fault"] = {"kind": "cpu_quota", "rank": 1, "start_s": 20, "duration_s": 10}
    old["expect"] = {"kb_entry": "straggler_rank", "ranks": [1], "peers": "ignored"}
    s = load_scenario(write(tmp_path, old))
    assert s.faults[0].kind == "cpu_quota" and s.faults[0].expect.ranks == (1,)
    old["fault"], old["expect"] = {"kind": "none"}, {"kb_entry": None, "ranks": []}
    assert load_scenario(write(tmp_path, old)).healthy


@pytest.mark.parametrize("data, message", [
    (with_fault(rank=5), "faults[0].rank: 5 is not a rank of this 3-rank job"),
    (with_fault(kind="netem"), "faults[0].kind: 'netem' is not one of"),
    (with_fault(duration_s=90), "faults[0].duration_s: the last burst ends at 110 s"),
    (with_fault(every_s=25, times=4), "faults[0].duration_s: the last burst ends at 105 s"),
    (with_fault(times=2), "faults[0].every_s: missing"),
    (with_fault(every_s=5), "faults[0].every_s: 5 is not longer than the fault's duration_s"),
    (with_fault(ranks=[0]), "faults[0].rank: give exactly one target"),
    (with_fault(strength="high"), "faults[0].strength: must be in (0, 1], got 'high'"),
    (with_fault(kind="memcpy_stall"), "faults[0].kind: memcpy_stall is a knob of the GPU stand-in only"),
    (with_fault(kind="thp_off"), "faults[0].target: thp_off changes the whole node"),
    (with_fault(expect={"kb_entry": "gremlins"}), "faults[0].expect.kb_entry: 'gremlins' is not null or a KB"),
    (with_fault(expect={"kb_entry": None, "scope": "rack"}), "faults[0].expect.scope: 'rack' is not rank, job"),
    (with_fault(expect={"kb_entry": None, "persists": "yes"}), "faults[0].expect.persists: must be true or false"),
    ({**BASE, "window": 2}, "window: unknown field"),
    ({**BASE, "ranks": None}, "ranks: must be"),
    ({**BASE, "events": [{"kind": "reboot", "at_s": 5}]}, "events[0].kind: 'reboot' is not one of restart"),
    ({**BASE, "events": [{"kind": "restart", "at_s": 500}]}, "events[0].at_s: 500 is not within (0, duration_s)"),
    ({**BASE, "phases": {"eval": {"every_steps": 0, "steps": 5}}}, "phases.eval.every_steps: 0 is not a positive"),
    ({**BASE, "rank_args": {1: {"gpus": 2}}}, "rank_args.1.gpus: unknown field"),
    ({**BASE, "rank_args": {7: {"batch": 2}}}, "rank_args: key 7 is not a rank"),
    ({**BASE, "faults": None}, "faults: must be a list of faults"),
])
def test_bad_scenario_files_name_the_file_and_the_field(tmp_path, data, message):
    p = write(tmp_path, data, "bad.yaml")
    with pytest.raises(ScenarioError) as e:
        load_scenario(p)
    assert str(e.value).startswith(f"{p}: ") and message in str(e.value), str(e.value)
