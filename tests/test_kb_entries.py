"""Every shipped KB entry: vectors that must match it (and rank it first), and
near-misses that must not match it. Plus the loader's error messages.

The anomalies are hand-built the way the model reports them: a realistic
healthy window with the fault's features changed, peer z-scores of the
faulty rank, and NLL contributions of z^2/2 for the deviating features
(what a diagonal Gaussian component gives for a standardized feature).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fleetscope.streams.diagnosis.anomaly import Anomaly
from fleetscope.streams.diagnosis.kb import KB_DIR, KBError, load_kb
from fleetscope.streams.diagnosis.matcher import diagnose
from fleetscope.streams.model.roles import ROLES
from support.kb_cases import CASES, HEALTHY, anomaly  # noqa: F401

REQUIRED = {"gpu_power_thermal_throttling", "numa_misplacement", "irq_locality_miss", "huge_page_coverage_loss",
            "cpu_contention_noisy_neighbour", "straggler_rank", "slow_degraded_link", "h2d_copy_stall_pageable",
            "gpu_memory_leak", "dataloader_input_stall", "python_gc_storm", "xid_hardware_error",
            # issue 16: the loud failures, and the software causes behind most real stragglers
            "hung_collective", "crashed_rank", "gpu_ecc_row_remap", "pipeline_stage_imbalance",
            "sequence_length_imbalance"}

@pytest.fixture(scope="module")
def kb():
    return load_kb()


def _anomaly(case) -> Anomaly:
    return anomaly(*case)


def test_the_required_entries_ship_and_load(kb):
    assert REQUIRED <= set(kb)
    assert set(CASES) == set(kb), "every KB entry needs match and near-miss cases here"
    for entry in kb.values():
        assert entry.description and entry.evidence
        assert entry.remediation.risk in ("low", "medium", "high")


@pytest.mark.parametrize("name", sorted(CASES))
def test_entry_matches_its_fault_and_ranks_first(kb, name):
    for case in CASES[name][0]:
        d = diagnose(_anomaly(case), kb)
        assert d.best == name, f"{name}: best was {d.best}; matches {[(m.entry, m.confidence) for m in d.matches]}"
        m = d.matches[0]
        assert 0.5 < m.confidence <= 1.0
        assert m.similarity > 0.5, f"{name}: the fingerprint disagrees with the KB pattern ({m.similarity})"
        assert m.held, "a match says which conditions held"
        shown = {k for k in m.evidence if not k.startswith("peer_z.")}
        assert shown and shown <= set(kb[name].evidence)


@pytest.mark.parametrize("name", sorted(CASES))
def test_entry_rejects_near_misses(kb, name):
    for case in CASES[name][1]:
        d = diagnose(_anomaly(case), kb)
        assert name not in [m.entry for m in d.matches], f"{name} matched near-miss {case}"


def test_healthy_window_matches_nothing_and_stays_visible(kb):
    d = diagnose(anomaly(peer_z={"gpu_util": 0.3, "nccl_time_frac": -0.8}, contributions={"gpu_util": 0.4}), kb)
    assert d.matches == [] and d.best == "unmatched" and d.confidence == 0.0
    rows = d.rows()
    assert [r.entry for r in rows] == ["unmatched"]
    assert rows[0].evidence["gpu_util"] == 95.0  # the top attributed feature is shown


def test_masked_feature_never_satisfies_a_rule(kb):
    a = anomaly({"gpu_throttled": 1, "gpu_temp_c": 90}, {"gpu_sm_clock_mhz": -6})
    del a.features["gpu_throttled"]
    assert "gpu_power_thermal_throttling" not in [m.entry for m in diagnose(a, kb).matches]


def test_pattern_agreement_raises_confidence(kb):
    """Same rules held; the window whose fingerprint points the KB's way is surer."""
    feats = {"python_gc_frac": 0.3, "python_gc_per_s": 50}
    along = diagnose(anomaly(feats, {"python_gc_frac": 8}), kb).matches[0]
    across = diagnose(anomaly(feats, {"python_gc_frac": 8, "disk_write_bytes_per_s": 12}), kb)
    across_m = next(m for m in across.matches if m.entry == "python_gc_storm")
    assert along.entry == "python_gc_storm"
    assert along.confidence > across_m.confidence


# ---- loader errors name the file and the field ----------------------------------

def _write(tmp_path: Path, name: str, doc: dict) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def _good(name: str = "demo") -> dict:
    return {"name": name, "description": "d", "fingerprint": {"cpu": 1.0},
            "rules": {"all": [{"feature": "cpu_busy_frac", "op": ">=", "value": 0.9}]},
            "evidence": ["cpu_busy_frac"],
            "remediation": {"command": "kubectl cordon {host}", "risk": "low", "auto": False}}


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.pop("rules"), "missing field `rules`"),
    (lambda d: d["rules"]["all"][0].update(op="=>"), "rules.all[0].op"),
    (lambda d: d["rules"]["all"][0].update(value="high"), "rules.all[0].value"),
    (lambda d: d["fingerprint"].update(gpu=1.0), "fingerprint"),
    (lambda d: d.update(name="other"), "must equal the file name"),
    (lambda d: d["remediation"].update(command="echo always > /sys/kernel/mm/x"), "remediation.command"),
    (lambda d: d["remediation"].update(risk="none"), "remediation.risk"),
    (lambda d: d["remediation"].pop("auto"), "remediation.auto"),
    (lambda d: d["remediation"].update(command="kill {PID}"), "placeholder"),
    (lambda d: (d["remediation"].pop("command"), d["remediation"].update(write={"path": "/etc/x", "value": "1"})),
     "remediation.write.path"),
    (lambda d: d.update(extra=1), "unknown fields ['extra']"),
    (lambda d: d.update(roles=["culprit", "bystander"]), "roles"),
    (lambda d: d.update(roles=[]), "roles"),
    (lambda d: d["rules"].update({"or": {"all": []}}), "rules.or: must be a list"),
    (lambda d: d["rules"].update({"or": [{"all": []}]}), "rules.or[0]: give at least one condition"),
    (lambda d: d["rules"].update({"or": [{"when": []}]}), "rules.or[0]: unknown fields"),
    (lambda d: d["rules"].update({"or": [{"any": [{"feature": "cpu_busy_frac", "op": "=>", "value": 1}]}]}),
     "rules.or[0].any[0].op"),
    (lambda d: d["rules"].update({"or": [{"any": [{"feature": "cpu_busy_frac", "op": ">=", "value": 1}],
                                          "remediation": {"command": "ss -tin", "risk": "low"}}]}),
     "rules.or[0].remediation.auto"),
    (lambda d: d["rules"].update({"or": [{"any": [{"feature": "cpu_busy_frac", "op": ">=", "value": 1}],
                                          "remediation": "ss -tin"}]}), "rules.or[0]: `remediation` must be a dict"),
])
def test_loader_error_names_file_and_field(tmp_path, mutate, field):
    doc = _good()
    mutate(doc)
    _write(tmp_path, "demo", doc)
    with pytest.raises(KBError) as err:
        load_kb(tmp_path)
    assert "demo.yaml" in str(err.value) and field in str(err.value)


def test_a_job_wide_slowdown_explains_the_job_and_its_nodes_not_a_culprit_its_peers_wait_for(kb):
    """The same window, diagnosed by its role: flagged `job` (no rank named) it is a job-wide slowdown; the
    culprit whose peers wait for it slowed the job itself, and an entry for a rank must say why."""
    features, peer_z, contributions = CASES["job_wide_slowdown"][0][0]
    case = anomaly(features, peer_z, contributions)
    for role in ("job", "node", ""):   # "" : stored before roles existed
        case.role = role
        assert diagnose(case, kb).best == "job_wide_slowdown", role
    for role in ("culprit", "waiting"):
        case.role = role
        assert "job_wide_slowdown" not in [m.entry for m in diagnose(case, kb).matches], role
    assert kb["job_wide_slowdown"].roles == ("job", "node") and kb["straggler_rank"].roles == ROLES


def test_a_job_slowed_by_load_from_outside_it_is_a_noisy_neighbour_not_a_slowdown_of_unknown_cause(kb):
    """The same job-wide slowdown, where the host's load from outside the job rose by 0.9 of a core
    (model/outside_load.py): job_wide_slowdown's `unless` rule gives way to the entry that names the cause.
    Without the outside features (masked), the slowdown is the job's as before."""
    features, peer_z, contributions = CASES["job_wide_slowdown"][0][0]
    outside = {**features, "cpu_busy_frac": 1.0, "outside_cpu_cores": 1.55, "outside_cpu_rise_cores": 0.9}
    for role in ("job", "node"):
        case = anomaly(outside, peer_z, contributions)
        case.role = role
        entries = [m.entry for m in diagnose(case, kb).matches]
        assert entries[0] == "cpu_contention_noisy_neighbour" and "job_wide_slowdown" not in entries, (role, entries)
    below = anomaly({**outside, "outside_cpu_rise_cores": 0.3}, peer_z, contributions)
    below.role = "job"
    assert diagnose(below, kb).best == "job_wide_slowdown"


def test_a_rank_that_died_after_its_gpu_reported_an_xid_is_diagnosed_as_the_xid_not_a_crash(kb):
    """Xid 79 (the GPU fell off the bus), then the rank's process ended in the same window: the hardware is the
    cause (a restart on that GPU dies again), so crashed_rank's `unless` gives way to xid_hardware_error. The same
    crash with no Xid is a crash."""
    features, *rest = CASES["xid_hardware_error"][0][0]
    died = {**features, "rank_crashed": 1, "process_exit_signal": 9}
    entries = [m.entry for m in diagnose(anomaly(died, *rest), kb).matches]
    assert entries[0] == "xid_hardware_error" and "crashed_rank" not in entries, entries
    no_xid = {k: v for k, v in died.items() if not k.startswith("gpu_xid")}
    assert diagnose(anomaly(no_xid, *rest), kb).best == "crashed_rank"


def test_an_unless_condition_is_checked_like_any_other_and_a_masked_one_holds_none(tmp_path):
    doc = _good()
    doc["rules"]["unless"] = [{"feature": "cpu_steal_frac", "op": ">=", "value": 0.05}]
    _write(tmp_path, "demo", doc)
    entry = load_kb(tmp_path)["demo"]
    assert [c.describe() for c in entry.unless_rules] == ["cpu_steal_frac >= 0.05"]
    case = anomaly({"cpu_busy_frac": 0.95})
    del case.features["cpu_steal_frac"]
    assert diagnose(case, {"demo": entry}).best == "demo"
    case.features["cpu_steal_frac"] = 0.2
    assert diagnose(case, {"demo": entry}).matches == []
    doc["rules"]["unless"] = [{"feature": "cpu_steal_fraction", "op": ">=", "value": 0.05}]
    _write(tmp_path, "demo", doc)
    with pytest.raises(KBError, match="cpu_steal_fraction"):
        load_kb(tmp_path)


def test_a_support_condition_alone_makes_no_candidate_and_its_names_are_checked(tmp_path):
    doc = _good()
    doc["rules"]["support"] = [{"peer_z": "runq_wait_threads", "op": ">=", "value": 3}]
    doc["rules"]["all"] = []
    doc["rules"]["any"] = [{"feature": "cpu_steal_frac", "op": ">=", "value": 0.05}]
    _write(tmp_path, "demo", doc)
    entry = load_kb(tmp_path)["demo"]
    assert [c.describe() for c in entry.support_rules] == ["peer_z.runq_wait_threads >= 3"]
    waits = anomaly({"cpu_busy_frac": 0.95, "cpu_steal_frac": 0.0}, {"runq_wait_threads": 8})
    assert diagnose(waits, {"demo": entry}).matches == []        # support held, nothing else: no candidate
    waits.features["cpu_steal_frac"] = 0.2
    held = diagnose(waits, {"demo": entry}).matches[0].held
    assert held == ("cpu_steal_frac >= 0.05", "peer_z.runq_wait_threads >= 3")
    doc["rules"]["support"] = [{"peer_z": "runq_wait", "op": ">=", "value": 3}]
    _write(tmp_path, "demo", doc)
    with pytest.raises(KBError, match="runq_wait"):
        load_kb(tmp_path)


def test_an_or_block_is_another_way_the_cause_shows_and_counts_only_its_own_conditions(tmp_path):
    doc = _good()
    doc["rules"]["or"] = [{"all": [{"feature": "cpu_steal_frac", "op": ">=", "value": 0.05}],
                           "any": [{"peer_z": "runq_wait_threads", "op": ">=", "value": 3}]}]
    doc["rules"]["unless"] = [{"feature": "outside_cpu_rise_cores", "op": ">=", "value": 0.5}]
    _write(tmp_path, "demo", doc)
    entry = load_kb(tmp_path)["demo"]
    neither = anomaly({"cpu_busy_frac": 0.5, "cpu_steal_frac": 0.2}, {"runq_wait_threads": 1})
    assert diagnose(neither, {"demo": entry}).matches == []      # the `or` block's `any` did not hold
    neither.peer_z["runq_wait_threads"] = 8
    m = diagnose(neither, {"demo": entry}).matches[0]
    assert m.held == ("cpu_steal_frac >= 0.05", "peer_z.runq_wait_threads >= 3")
    assert m.confidence == pytest.approx(0.5 * 2 / 2 + 0.5 * max(0.0, m.similarity))
    main = anomaly({"cpu_busy_frac": 0.95, "cpu_steal_frac": 0.2}, {"runq_wait_threads": 8})
    assert diagnose(main, {"demo": entry}).matches[0].held == ("cpu_busy_frac >= 0.9",)   # the main block first
    neither.features["outside_cpu_rise_cores"] = 1.0
    assert diagnose(neither, {"demo": entry}).matches == []      # `unless` applies to every block
    doc["rules"]["or"][0]["any"][0]["peer_z"] = "runq_wait"
    _write(tmp_path, "demo", doc)
    with pytest.raises(KBError, match="runq_wait"):
        load_kb(tmp_path)


def test_an_or_block_may_bring_its_own_remediation_planned_where_that_block_held(tmp_path):
    """A cause that shows two ways may want two fixes: the `or` block's remediation is planned for a diagnosis
    whose held rules show that block held; the main block's diagnoses, and blocks without one, get the entry's."""
    doc = _good()
    doc["rules"]["or"] = [{"all": [{"feature": "cpu_steal_frac", "op": ">=", "value": 0.05}],
                           "remediation": {"command": "ss -tin state established", "risk": "low", "auto": True}},
                          {"any": [{"peer_z": "runq_wait_threads", "op": ">=", "value": 3}]}]
    _write(tmp_path, "demo", doc)
    entry = load_kb(tmp_path)["demo"]
    by_block = diagnose(anomaly({"cpu_busy_frac": 0.5, "cpu_steal_frac": 0.2}, {}), {"demo": entry}).matches[0]
    assert entry.remediation_for(by_block.held).argv == ("ss", "-tin", "state", "established")
    by_main = diagnose(anomaly({"cpu_busy_frac": 0.95, "cpu_steal_frac": 0.2}, {}), {"demo": entry}).matches[0]
    assert entry.remediation_for(by_main.held).argv == ("kubectl", "cordon", "{host}")   # the main block held first
    by_third = diagnose(anomaly({"cpu_busy_frac": 0.5}, {"runq_wait_threads": 8}), {"demo": entry}).matches[0]
    assert entry.remediation_for(by_third.held) == entry.remediation
    assert entry.remediation_for(()) == entry.remediation                    # held rules unknown: the entry's


def test_loader_reports_every_bad_file_and_accepts_good_ones(tmp_path):
    _write(tmp_path, "good", _good("good"))
    assert set(load_kb(tmp_path)) == {"good"}
    bad = _good("bad1")
    bad["rules"] = {}
    _write(tmp_path, "bad1", bad)
    (tmp_path / "bad2.yaml").write_text("name: [unclosed", encoding="utf-8")
    with pytest.raises(KBError) as err:
        load_kb(tmp_path)
    assert "bad1.yaml" in str(err.value) and "bad2.yaml" in str(err.value)
    with pytest.raises(KBError, match="no \\*.yaml"):
        load_kb(tmp_path / "empty")


def test_shipped_kb_dir_is_the_repository_kb():
    assert KB_DIR == Path(__file__).resolve().parents[1] / "kb"


def test_a_cpu_only_job_can_match_an_entry_whose_gpu_condition_it_cannot_answer(kb):
    """dataloader_input_stall's `gpu_util <= 60` says if_present: a job without GPU features is judged
    on its storage signs alone; a GPU job that is still fed is not matched."""
    cpu_only = {k: v for k, v in HEALTHY.items() if not k.startswith(("gpu_", "cuda_", "nccl_"))}
    stalled = Anomaly("acme", "train-1", "node-a", 1, 1_700_000_000_000_000_000, score=40.0, threshold=25.0,
                      detectors=["peer"], contributions={"proc_read_bytes_per_s": 30.0},
                      peer_z={"proc_read_bytes_per_s": 40.0},
                      features={**cpu_only, "proc_read_bytes_per_s": 8e7})
    got = diagnose(stalled, kb)
    assert got.best == "dataloader_input_stall", got.matches
    assert "gpu_util <= 60 or absent" in got.matches[0].held
    fed = Anomaly("acme", "train-1", "node-a", 1, 1_700_000_000_000_000_000, score=40.0, threshold=25.0,
                  detectors=["peer"], contributions={"proc_read_bytes_per_s": 30.0},
                  peer_z={"proc_read_bytes_per_s": 40.0}, features={**HEALTHY, "proc_read_bytes_per_s": 8e7})
    assert "dataloader_input_stall" not in [m.entry for m in diagnose(fed, kb).matches]


# ---- the KB against the feature catalogue (streams/feature_catalogue.py) ------------



@pytest.mark.parametrize("where, mutate", [
    ("rules", lambda d: d["rules"]["all"][0].update(feature="cpu_busy_fraction")),
    ("evidence", lambda d: d.update(evidence=["cpu_busy_frac", "cpu_busy_fraction"])),
    ("rules", lambda d: d["rules"].update(any=[{"peer_z": "cpu_busy_fraction", "op": ">=", "value": 3}])),
])
def test_a_feature_no_builder_emits_is_a_load_error_naming_file_and_feature(tmp_path, where, mutate):
    doc = _good()
    mutate(doc)
    _write(tmp_path, "demo", doc)
    with pytest.raises(KBError) as err:
        load_kb(tmp_path)
    text = str(err.value)
    assert "demo.yaml" in text and "'cpu_busy_fraction'" in text and where in text, text


def test_every_entry_is_reachable(kb):
    """Issue 16 computed what the four waiting entries needed (Xid count, GPU temperature and clock, peer z
    of the joined GPU and node features) and rewrote irq_locality_miss on what the pipeline emits."""
    assert {n: e.missing for n, e in kb.items() if not e.reachable} == {}


def test_rules_that_can_never_hold_must_say_what_they_wait_for(tmp_path):
    """A peer z of a node feature the scorer does not join and compare is never computed: an entry resting
    on it alone must list it."""
    doc = _good()
    doc["rules"] = {"all": [{"peer_z": "hugepages_used_frac", "op": "<=", "value": -3}]}
    _write(tmp_path, "demo", doc)
    with pytest.raises(KBError, match=r"demo.yaml: rules can never hold.*peer_z.hugepages_used_frac"):
        load_kb(tmp_path)
    doc["requires"] = ["peer_z.hugepages_used_frac"]
    _write(tmp_path, "demo", doc)
    assert load_kb(tmp_path)["demo"].missing == ("peer_z.hugepages_used_frac",)
    doc["requires"] = ["peer_z.hugepages_used_frac", "cpu_busy_frac"]     # computed today: a stale wait
    _write(tmp_path, "demo", doc)
    with pytest.raises(KBError, match=r"demo.yaml: requires: \['cpu_busy_frac'\] are computed now"):
        load_kb(tmp_path)


def test_kb_list_and_show_say_no_entry_waits(capsys):
    from fleetscope.cli.main import main
    assert main(["kb", "list"]) == 0
    out = capsys.readouterr().out
    assert "not reachable yet" not in out and all(name in out for name in REQUIRED)
    assert main(["kb", "show", "irq_locality_miss"]) == 0
    assert "not reachable yet" not in capsys.readouterr().out


def test_huge_page_loss_on_a_single_node_job_matches_on_the_ranks_own_faults(kb):
    """One node: no peer node to compare THP coverage with; the rank's own minor faults stand out. It
    matches, with a low confidence: the fingerprint leads with faults up while the entry's pattern leads
    with coverage down."""
    d = diagnose(anomaly({"thp_coverage_frac": 0.05, "proc_minflt_per_s": 90000}, {"proc_minflt_per_s": 6}), kb)
    assert "huge_page_coverage_loss" in [m.entry for m in d.matches]
    healthy = diagnose(anomaly({"proc_minflt_per_s": 90000}, {"proc_minflt_per_s": 6}), kb)   # THP still 0.8
    assert "huge_page_coverage_loss" not in [m.entry for m in healthy.matches]


def test_a_crashed_rank_is_diagnosed_crashed_whatever_else_its_last_window_shows(kb):
    """A crashed rank's last window can be odd to the model too (here: preempted, its IRQs on its CPUs, as
    crash_one_rank's was). An entry that holds on a loud feature has confidence 1 (diagnosis/matcher.py): the
    crash was observed; the IRQ entry is inferred (0.66), and before this it beat crashed_rank (0.26)."""
    features, peer_z = CASES["irq_locality_miss"][0][0]
    d = diagnose(anomaly({**features, "rank_crashed": 1.0, "process_exit_signal": 9.0}, peer_z), kb)
    assert [m.entry for m in d.matches][:2] == ["crashed_rank", "irq_locality_miss"]
    assert d.matches[0].loud and d.matches[0].confidence == 1.0 > d.matches[1].confidence
    assert not any(m.loud for m in diagnose(anomaly(features, peer_z), kb).matches)
