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

REQUIRED = {"gpu_power_thermal_throttling", "numa_misplacement", "irq_locality_miss", "huge_page_coverage_loss",
            "cpu_contention_noisy_neighbour", "straggler_rank", "slow_degraded_link", "h2d_copy_stall_pageable",
            "gpu_memory_leak", "dataloader_input_stall", "python_gc_storm", "xid_hardware_error",
            # issue 16: the loud failures, and the software causes behind most real stragglers
            "hung_collective", "crashed_rank", "gpu_ecc_row_remap", "pipeline_stage_imbalance",
            "sequence_length_imbalance"}

HEALTHY = {
    "cpu_busy_frac": 0.45, "cpu_user_frac": 0.35, "cpu_system_frac": 0.05, "cpu_iowait_frac": 0.01,
    "cpu_steal_frac": 0.0, "cpu_irq_frac": 0.005, "cpu_softirq_frac": 0.01, "cpu_busy_max_core_frac": 0.9,
    "mem_used_frac": 0.5, "thp_coverage_frac": 0.8, "hugepages_used_frac": 0.0, "numa_miss_ratio": 0.01,
    "page_faults_per_s": 2000.0, "major_faults_per_s": 0.0, "irq_per_s": 20000.0, "net_rx_bytes_per_s": 1e8,
    "net_tx_bytes_per_s": 1e8, "disk_read_bytes_per_s": 1e6, "disk_write_bytes_per_s": 1e6,
    "context_switches_per_s": 30000.0, "agent_dropped_events": 0.0,
    "offcpu_threads": 2.0, "ctx_switches_per_s": 5000.0, "tcp_retransmits_per_s": 0.0, "irq_traced_per_s": 5000.0,
    "irq_max_cpu_share": 0.1, "tcp_tx_bytes_per_s": 1e8, "tcp_rx_bytes_per_s": 1e8,
    "gpu_util": 95.0, "gpu_proc_sm_util": 90.0, "gpu_power_w": 600.0, "gpu_ofu": 0.4, "gpu_tensor_util": 0.5,
    "gpu_energy_j": 600.0, "gpu_proc_mem_bytes": 60e9, "gpu_throttled": 0.0, "gpu_sm_clock_mhz": 1980.0,
    "gpu_xid_count": 0.0, "gpu_temp_c": 65.0,
    "cuda_launch_per_s": 20000.0, "cuda_sync_frac": 0.1, "cuda_memcpy_bytes_per_s": 2e9,
    "cuda_memcpy_htod_bytes_per_s": 1e9, "cuda_memcpy_lat_p50_ns": 20000.0, "cuda_memcpy_lat_p99_ns": 200000.0,
    "cuda_mem_live_bytes": 60e9, "cuda_malloc_free_balance_bytes": 0.0, "cuda_errors_per_s": 0.0,
    "cuda_memcpy_frac": 0.03,
    "nccl_calls_per_s": 200.0, "nccl_bytes_per_s": 5e10, "nccl_lat_p50_ns": 1e6, "nccl_lat_p99_ns": 5e6,
    "nccl_algbw_gbps": 150.0, "nccl_time_frac": 0.3, "nccl_allreduce_algbw_gbps": 150.0,
    "python_gc_frac": 0.005, "python_gc_per_s": 2.0, "python_calls_per_s": 1e5, "python_top_func_share": 0.1,
    "torch_ops_per_s": 5000.0, "torch_op_time_frac": 0.6, "torch_matmul_ops_per_s": 1000.0,
    "torch_elementwise_ops_per_s": 3000.0, "torch_other_ops_per_s": 1000.0,
}


def anomaly(features: dict | None = None, peer_z: dict | None = None, contributions: dict | None = None) -> Anomaly:
    peer_z = dict(peer_z or {})
    if contributions is None:
        contributions = {f: z * z / 2 for f, z in peer_z.items() if abs(z) >= 2}
    return Anomaly("acme", "train-1", "node-a", 3, 1_700_000_000_000_000_000, score=40.0, threshold=25.0,
                   detectors=["gmm", "peer"], contributions=contributions, peer_z=peer_z,
                   features={**HEALTHY, **(features or {})})


# entry -> (must match, must not match); each case is (features, peer_z[, contributions])
CASES: dict[str, tuple[list, list]] = {
    "gpu_power_thermal_throttling": (
        [({"gpu_throttled": 1, "gpu_temp_c": 88, "gpu_sm_clock_mhz": 1400},
          {"gpu_sm_clock_mhz": -6, "gpu_temp_c": 4, "nccl_time_frac": -3.2}),
         # the whole job runs hot: no peer deviation, the model's contributions only
         ({"gpu_throttled": 1, "gpu_temp_c": 90, "gpu_sm_clock_mhz": 1500}, {},
          {"gpu_temp_c": 8.0, "gpu_sm_clock_mhz": 6.0})],
        [({"gpu_temp_c": 90}, {"gpu_temp_c": 5}),                        # hot, but clocks not limited
         ({"gpu_throttled": 1, "gpu_temp_c": 70}, {"gpu_sm_clock_mhz": -0.5})],  # a flag blip, clocks normal
    ),
    "numa_misplacement": (
        [({"numa_miss_ratio": 0.4, "cuda_memcpy_lat_p99_ns": 900000}, {"numa_miss_ratio": 6, "cuda_memcpy_lat_p99_ns": 3})],
        [({"numa_miss_ratio": 0.04}, {"numa_miss_ratio": 5}),            # relative jump, tiny absolute
         ({"numa_miss_ratio": 0.15}, {"numa_miss_ratio": 0.3})],         # mild, host-wide, below 0.3
    ),
    "irq_locality_miss": (    # no rank -> CPU mapping is reported: the node's IRQ concentration and the
        # rank being the one preempted (see the entry's comment)
        [({"irq_max_cpu_share": 0.8, "cpu_softirq_frac": 0.12},
          {"offcpu_threads": 4, "proc_invol_ctx_per_s": 5, "irq_max_cpu_share": 3})],
        [({"irq_max_cpu_share": 0.2, "cpu_softirq_frac": 0.1}, {"offcpu_threads": 4}),   # IRQs spread out
         ({"irq_max_cpu_share": 0.8}, {"offcpu_threads": 0.5})],   # concentrated, but no rank pays for it
    ),
    "huge_page_coverage_loss": (
        [({"thp_coverage_frac": 0.1, "page_faults_per_s": 80000}, {"thp_coverage_frac": -7, "page_faults_per_s": 5})],
        [({"thp_coverage_frac": 0.5}, {"thp_coverage_frac": -4}),        # dropped, still above 0.3
         ({"thp_coverage_frac": 0.1}, {"thp_coverage_frac": 0.1})],      # no THP anywhere: nothing was lost
    ),
    "cpu_contention_noisy_neighbour": (
        [({"cpu_busy_frac": 0.97, "cpu_steal_frac": 0.15, "offcpu_threads": 9},
          {"offcpu_threads": 5, "ctx_switches_per_s": 4, "cpu_busy_frac": 3})],
        [({"cpu_busy_frac": 0.5, "cpu_steal_frac": 0.1}, {"cpu_steal_frac": 4}),
         ({"cpu_busy_frac": 0.95}, {"cpu_busy_frac": 0.2})],            # busy by itself, nobody waiting
    ),
    "straggler_rank": (
        [({"nccl_time_frac": 0.05}, {"nccl_time_frac": -6, "nccl_lat_p50_ns": -4, "cpu_busy_frac": 2.5}),
         ({"torch_comm_wait_frac": 0.04}, {"torch_comm_wait_frac": -9})],   # a CPU (gloo) job
        [({"nccl_time_frac": 0.25}, {"nccl_time_frac": -2}),            # within peer noise
         ({"nccl_time_frac": 0.6}, {"nccl_time_frac": 5}),             # waits more: a peer of the straggler
         ({"torch_comm_wait_frac": 0.95}, {"torch_comm_wait_frac": 4})],  # the same in a gloo job
    ),
    "slow_degraded_link": (
        [({"nccl_algbw_gbps": 40, "nccl_lat_p99_ns": 3e7, "nccl_time_frac": 0.55},
          {"nccl_algbw_gbps": -7, "nccl_lat_p99_ns": 6, "nccl_time_frac": 4})],
        [({"nccl_algbw_gbps": 40}, {"nccl_algbw_gbps": -7, "nccl_lat_p99_ns": 1}),
         ({"nccl_lat_p99_ns": 2e7}, {"nccl_lat_p99_ns": 5, "nccl_algbw_gbps": -1})],
    ),
    "h2d_copy_stall_pageable": (
        [({"cuda_memcpy_frac": 0.4, "cuda_memcpy_htod_bytes_per_s": 5e8, "cuda_memcpy_lat_p50_ns": 2e6},
          {"cuda_memcpy_lat_p50_ns": 6, "cuda_memcpy_frac": 5})],
        [({"cuda_memcpy_frac": 0.4, "cuda_memcpy_htod_bytes_per_s": 1e7}, {"cuda_memcpy_frac": 5}),
         ({"cuda_memcpy_frac": 0.1, "cuda_memcpy_htod_bytes_per_s": 5e8}, {"cuda_memcpy_lat_p50_ns": 4})],
    ),
    "gpu_memory_leak": (
        [({"cuda_malloc_free_balance_bytes": 512 * 2**20, "cuda_mem_live_bytes": 75e9},
          {"cuda_mem_live_bytes": 4, "cuda_malloc_free_balance_bytes": 6})],
        [({"cuda_malloc_free_balance_bytes": 32 * 2**20}, {"cuda_malloc_free_balance_bytes": 5}),
         ({"cuda_malloc_free_balance_bytes": 256 * 2**20}, {"cuda_malloc_free_balance_bytes": 0.2})],  # all ranks warm up
    ),
    "dataloader_input_stall": (
        [({"gpu_util": 30, "cpu_iowait_frac": 0.25, "torch_ops_per_s": 1500},
          {"cpu_iowait_frac": 5, "torch_ops_per_s": -5, "gpu_util": -5})],
        [({"gpu_util": 90, "cpu_iowait_frac": 0.3}, {"cpu_iowait_frac": 5}),   # IO waits, GPU still fed
         ({"gpu_util": 40, "cpu_iowait_frac": 0.02}, {"cpu_iowait_frac": 0.5, "torch_ops_per_s": -1})],
    ),
    "python_gc_storm": (
        [({"python_gc_frac": 0.3, "python_gc_per_s": 50}, {"python_gc_frac": 8, "python_gc_per_s": 6})],
        [({"python_gc_frac": 0.03}, {"python_gc_frac": 6}),
         ({"python_gc_frac": 0.1}, {"python_gc_frac": 0.5})],            # steady job-wide GC below 0.2
    ),
    "xid_hardware_error": (
        [({"gpu_xid_count": 2, "cuda_errors_per_s": 5}, {"gpu_xid_count": 10, "cuda_errors_per_s": 6})],
        [({"cuda_errors_per_s": 100}, {"cuda_errors_per_s": 8})],       # API errors alone are no hardware fault
    ),
    "gpu_ecc_row_remap": (
        [({"gpu_ecc_dbe_count": 1, "gpu_ecc_new_errors": 1}, {}, {"gpu_ecc_new_errors": 1.0}),
         ({"gpu_row_remap_pending": 2, "gpu_ecc_uncorrected": 3}, {}, {"gpu_row_remap_pending": 1.0})],
        [({"gpu_ecc_uncorrected": 3}, {}, {"gpu_util": 1.0})],     # an old count, nothing new, nothing pending
    ),
    "hung_collective": (
        [({"collective_stalled": 1}, {}, {"collective_stalled": 1.0})],
        [({"nccl_calls_per_s": 0.5}, {"nccl_calls_per_s": -4})],    # slow collectives are not a hang
    ),
    "crashed_rank": (
        [({"rank_vanished": 1}, {}, {"rank_vanished": 1.0})],
        [({"torch_ops_per_s": 10}, {"torch_ops_per_s": -8})],       # a rank that slowed down still reports
    ),
    "pipeline_stage_imbalance": (
        [({"torch_op_time_frac": 0.9, "torch_ops_per_s": 9000, "torch_comm_wait_frac": 0.02},
          {"torch_op_time_frac": 6, "torch_ops_per_s": 5, "torch_comm_wait_frac": -7})],
        [({"torch_op_time_frac": 0.9}, {"torch_op_time_frac": 6, "torch_comm_wait_frac": -7}),  # same op count
         ({"torch_ops_per_s": 9000}, {"torch_ops_per_s": 5, "torch_comm_wait_frac": -7})],     # ops, not time
    ),
    "sequence_length_imbalance": (
        [({"torch_op_time_frac": 0.9, "torch_comm_wait_frac": 0.02},
          {"torch_op_time_frac": 6, "torch_comm_wait_frac": -7, "torch_ops_per_s": 0.4})],
        [({"torch_op_time_frac": 0.9}, {"torch_op_time_frac": 6, "torch_ops_per_s": 5,
                                        "torch_comm_wait_frac": -7}),   # more ops: more layers, not longer batches
         ({"torch_op_time_frac": 0.9}, {"torch_op_time_frac": 6})],     # computes more but nobody waits for it
    ),
}


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
])
def test_loader_error_names_file_and_field(tmp_path, mutate, field):
    doc = _good()
    mutate(doc)
    _write(tmp_path, "demo", doc)
    with pytest.raises(KBError) as err:
        load_kb(tmp_path)
    assert "demo.yaml" in str(err.value) and field in str(err.value)


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
