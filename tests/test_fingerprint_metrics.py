"""Fingerprints (order, normalization, comparability, similarity), attribution,
and the four fingerprint metrics on hand-made and matcher-made outcomes."""
from __future__ import annotations

import pytest

from fleetscope.streams.diagnosis.attribution import attribute
from fleetscope.streams.diagnosis.fingerprint import Fingerprint, pattern_vector, similarity
from fleetscope.streams.diagnosis.kb import load_kb
from fleetscope.eval.fingerprint_metrics import Outcome, fingerprint_metrics, outcome
from fleetscope.streams.diagnosis.subsystems import SUBSYSTEMS, subsystem_of
from support.kb_cases import CASES, anomaly

# ---- subsystems and attribution ---------------------------------------------------


def test_every_catalog_family_has_its_subsystem():
    expect = {"cpu_steal_frac": "cpu", "cpu_iowait_frac": "storage", "disk_read_bytes_per_s": "storage",
              "irq_rank_cpu_share": "network", "tcp_retransmits_per_s": "network", "offcpu_threads": "cpu",
              "numa_miss_ratio": "host_memory", "thp_coverage_frac": "host_memory", "gpu_sm_clock_mhz": "gpu_compute",
              "gpu_proc_mem_bytes": "gpu_memory", "cuda_malloc_free_balance_bytes": "gpu_memory",
              "cuda_memcpy_htod_bytes_per_s": "interconnect", "cuda_sync_frac": "cuda_runtime",
              "nccl_allreduce_algbw_gbps": "nccl", "python_gc_frac": "framework", "torch_ops_per_s": "framework"}
    assert {f: subsystem_of(f) for f in expect} == expect
    assert subsystem_of("agent_dropped_events") is None


def test_attribution_combines_contributions_and_peer_z_into_signed_shares():
    att = attribute({"gpu_sm_clock_mhz": 6.0, "gpu_temp_c": 2.0, "python_gc_frac": -3.0, "agent_dropped_events": 1.0},
                    {"gpu_sm_clock_mhz": -5.0, "nccl_time_frac": -3.0, "cpu_busy_frac": 0.4})
    fp = att.fingerprint.as_dict()
    assert list(fp) == list(SUBSYSTEMS)
    assert fp["gpu_compute"] < 0 and fp["nccl"] < 0        # clock and NCCL time both fell vs peers
    assert fp["framework"] == 0.0                           # a negative contribution is not evidence
    assert fp["cpu"] == 0.0                                 # |z| below the floor is noise
    assert sum(abs(v) for v in fp.values()) == pytest.approx(1.0)
    assert att.unattributed == ["agent_dropped_events"]
    assert att.top[0].feature == "gpu_sm_clock_mhz" and att.top[0].sign == -1
    # the gpu_temp_c contribution (no peer z) adds to gpu_compute's magnitude, never cancels it
    weights = {fs.feature: fs.weight for fs in att.top}
    attributed = sum(weights.values())
    assert abs(fp["gpu_compute"]) == pytest.approx((weights["gpu_sm_clock_mhz"] + weights["gpu_temp_c"]) / attributed)


def test_direction_unknown_without_peer_z_compares_by_magnitude():
    att = attribute({"gpu_temp_c": 8.0}, {})
    assert att.fingerprint.unsigned == frozenset({"gpu_compute"})
    down = pattern_vector({"gpu_compute": -1.0})
    assert similarity(att.fingerprint, down) == pytest.approx(1.0)
    signed_up = attribute({"gpu_temp_c": 8.0}, {"gpu_temp_c": 4.0}).fingerprint
    assert similarity(signed_up, down) == pytest.approx(-1.0)


def test_empty_attribution_is_an_empty_fingerprint():
    fp = attribute({}, {"gpu_util": 0.2}).fingerprint
    assert fp.is_empty() and fp.dominant() is None
    assert similarity(fp, pattern_vector({"cpu": 1.0})) == 0.0


# ---- comparability across jobs and hardware -------------------------------------

def test_fingerprint_is_scale_free_across_hardware():
    """An H100 job and an A10 job with the same relative fault give the same fingerprint."""
    big = attribute({"nccl_algbw_gbps": 40.0, "nccl_lat_p99_ns": 20.0}, {"nccl_algbw_gbps": -8.0, "nccl_lat_p99_ns": 6.0})
    small = attribute({"nccl_algbw_gbps": 4.0, "nccl_lat_p99_ns": 2.0}, {"nccl_algbw_gbps": -4.0, "nccl_lat_p99_ns": 3.0})
    assert big.fingerprint.values == pytest.approx(small.fingerprint.values)
    assert similarity(big.fingerprint, small.fingerprint) == pytest.approx(1.0)


def test_similarity_separates_different_faults():
    gc = attribute({"python_gc_frac": 30.0}, {"python_gc_frac": 8.0}).fingerprint
    leak = attribute({"cuda_mem_live_bytes": 30.0}, {"cuda_mem_live_bytes": 8.0}).fingerprint
    assert similarity(gc, leak) == pytest.approx(0.0)
    assert similarity(gc, gc) == pytest.approx(1.0)


def test_fingerprint_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown subsystems"):
        Fingerprint.from_shares({"gpu": 1.0})
    with pytest.raises(ValueError, match="not finite"):
        Fingerprint.from_shares({"cpu": float("nan")})
    with pytest.raises(ValueError, match="non-zero"):
        pattern_vector({"cpu": 0.0})
    with pytest.raises(ValueError, match="values"):
        Fingerprint((1.0,))


# ---- the four metrics on hand-made outcomes --------------------------------------

def O(label, detected, signature):  # noqa: N802 - reads like a table row
    return Outcome(label, detected, signature)


HAND = [
    O("python_gc_storm", True, "python_gc_storm"),     # fault, detected, right signature
    O("python_gc_storm", True, "straggler_rank"),      # fault, detected, wrong signature
    O("python_gc_storm", False, "unmatched"),          # fault, missed, no signature
    O("gpu_memory_leak", True, "unmatched"),           # fault, detected, no signature
    O("gpu_memory_leak", False, "unmatched"),
    O(None, False, "unmatched"),                       # healthy, quiet
    O(None, False, "unmatched"),
    O(None, True, "unmatched"),                        # healthy, false alarm, no signature
    O(None, False, "cpu_contention_noisy_neighbour"),  # healthy, signature fires
    O(None, True, "straggler_rank"),                   # healthy, false alarm with a signature
]


def test_metrics_on_hand_made_outcomes():
    m = fingerprint_metrics(HAND)
    assert (m.windows, m.faulty_windows, m.healthy_windows) == (10, 5, 5)
    assert m.signature_hit_rate == pytest.approx(1 / 5)
    assert m.per_class_hit_rate == {"gpu_memory_leak": 0.0, "python_gc_storm": pytest.approx(1 / 3)}
    assert m.signature_coverage == pytest.approx(1 / 2)
    # agree: rows 1, 2 (detected & signature), 3, 5, 6, 7 (quiet & unmatched), 10 (detected & signature) = 7
    assert m.detection_signature_agreement == pytest.approx(7 / 10)
    assert m.healthy_contamination == pytest.approx(2 / 5)


def test_metrics_with_empty_denominators_are_none():
    only_healthy = fingerprint_metrics([O(None, False, "unmatched")])
    assert only_healthy.signature_hit_rate is None and only_healthy.signature_coverage is None
    assert only_healthy.healthy_contamination == 0.0 and only_healthy.detection_signature_agreement == 1.0
    only_faulty = fingerprint_metrics([O("xid_hardware_error", True, "xid_hardware_error")])
    assert only_faulty.healthy_contamination is None and only_faulty.signature_hit_rate == 1.0
    empty = fingerprint_metrics([])
    assert empty.detection_signature_agreement is None and empty.windows == 0


def test_metrics_from_the_matcher_on_planted_faults():
    """The KB cases as a labelled run: every planted fault named, healthy windows clean."""
    kb = load_kb()
    outcomes = [outcome(anomaly(*case), name, True, kb) for name, (pos, _) in CASES.items() for case in pos]
    outcomes += [outcome(anomaly(*case), None, False, kb) for name, (_, neg) in CASES.items() for case in neg
                 if not _matches_any(anomaly(*case), kb)]
    outcomes += [outcome(anomaly(peer_z={"gpu_util": 0.5}), None, False, kb) for _ in range(5)]
    m = fingerprint_metrics(outcomes)
    assert m.signature_hit_rate == 1.0 and m.signature_coverage == 1.0
    assert m.healthy_contamination == 0.0 and m.detection_signature_agreement == 1.0
    assert m.healthy_windows >= 5 and len(m.per_class_hit_rate) == len(kb)
    with pytest.raises(ValueError, match="not a KB entry"):
        outcome(anomaly(), "made_up", True, kb)


def _matches_any(a, kb) -> bool:
    from fleetscope.streams.diagnosis.matcher import diagnose
    return bool(diagnose(a, kb).matches)
