"""Diagnoses in the real ClickHouse engine (chDB): the migration applies, rows
round-trip, re-emits dedupe, and the CLI handlers read and log through the
store. Remediation here runs only against a recording executor."""
from __future__ import annotations

import argparse
import time

import pytest

from fleetscope import config as config_mod
from fleetscope.cli.kb import diagnose_summary, parse_since, register
from fleetscope.store import ChdbStore
from fleetscope.streams.diagnosis.kb import load_kb
from fleetscope.streams.diagnosis.matcher import diagnose
from fleetscope.streams.diagnosis.records import diagnosis_columns, diagnosis_message
from support.kb_cases import CASES, anomaly
from support.recording_executor import RecordingExecutor

NOW_NS = (time.time_ns() // 1_000_000) * 1_000_000  # ms-aligned: the column is DateTime64(3)


@pytest.fixture(scope="module")
def kb():
    return load_kb()


def _diag(kb, name: str | None, rank: int = 3, window_ns: int = NOW_NS, host: str = "node-a"):
    a = anomaly(*CASES[name][0][0]) if name else anomaly(peer_z={"gpu_util": 0.3}, contributions={"gpu_util": 0.5})
    a.rank, a.window_start_ns, a.host = rank, window_ns, host
    return diagnose(a, kb)


def _store(tmp_path) -> ChdbStore:
    s = ChdbStore(tmp_path / "chdb")
    s.migrate()
    return s


def test_migration_creates_both_tables(tmp_path):
    with ChdbStore(tmp_path / "chdb") as s:
        assert "007_diagnoses" in s.migrate()
        meta = {r["name"]: r for r in s.query(
            "SELECT name, sorting_key, engine FROM system.tables WHERE database = {db:String}",
            {"db": s.database}).as_dicts()}
        assert meta["diagnoses"]["sorting_key"] == "tenant, job, rank, window_start, kb_entry"
        assert meta["diagnoses"]["engine"] == "ReplacingMergeTree"
        assert meta["remediation_log"]["engine"] == "MergeTree"
        assert s.migrate() == []


def test_diagnosis_rows_round_trip(tmp_path, kb):
    matched, unmatched = _diag(kb, "gpu_power_thermal_throttling"), _diag(kb, None, rank=5)
    cols = diagnosis_columns([matched, unmatched], emitted_at_ns=NOW_NS + 1_000_000)
    with _store(tmp_path) as s:
        assert s.insert("diagnoses", cols, dedupe_token="d-1") == len(matched.matches) + 1
        rows = s.query("SELECT rank, kb_entry, confidence, fingerprint, fingerprint_unsigned, evidence, rules_held, "
                       "detectors, score, toUnixTimestamp64Nano(window_start) AS w FROM diagnoses FINAL "
                       "ORDER BY rank, confidence DESC").as_dicts()
    best = rows[0]
    m = matched.matches[0]
    assert (best["rank"], best["kb_entry"], best["w"]) == (3, "gpu_power_thermal_throttling", NOW_NS)
    assert best["confidence"] == pytest.approx(m.confidence, abs=1e-6)
    assert best["fingerprint"] == pytest.approx(matched.attribution.fingerprint.as_dict(), abs=1e-6)
    assert best["evidence"] == pytest.approx(m.evidence)
    assert best["rules_held"] == list(m.held) and best["detectors"] == ["gmm", "peer"] and best["score"] == 40.0
    last = rows[-1]
    assert (last["rank"], last["kb_entry"], last["confidence"]) == (5, "unmatched", 0.0)
    assert last["evidence"]["gpu_util"] == 95.0 and "share.gpu_util" in last["evidence"]
    msg = diagnosis_message(matched)
    assert msg["matches"][0]["kb_entry"] == "gpu_power_thermal_throttling" and len(msg["fingerprint"]) == 10


def test_reemitted_window_keeps_one_row_per_entry(tmp_path, kb):
    d = _diag(kb, "python_gc_storm")
    with _store(tmp_path) as s:
        s.insert("diagnoses", diagnosis_columns([d], NOW_NS), dedupe_token="a")
        s.insert("diagnoses", diagnosis_columns([d], NOW_NS + 5_000_000), dedupe_token="b")
        assert s.query("SELECT count() FROM diagnoses FINAL").rows[0][0] == len(d.matches)
        assert s.query("SELECT toUnixTimestamp64Milli(max(emitted_at)) FROM diagnoses FINAL").rows[0][0] == \
            NOW_NS // 1_000_000 + 5


def test_diagnose_summary_ranks_by_confidence_then_count(tmp_path, kb):
    ds = [_diag(kb, "python_gc_storm", rank=r, window_ns=NOW_NS + i * 1_000_000_000)
          for i, r in enumerate((1, 1, 2))]
    ds += [_diag(kb, "slow_degraded_link", rank=4), _diag(kb, None, rank=6), _diag(kb, None, rank=7)]
    with _store(tmp_path) as s:
        s.insert("diagnoses", diagnosis_columns(ds, NOW_NS), dedupe_token="x")
        s.insert("diagnoses", diagnosis_columns([_diag(kb, "python_gc_storm")], NOW_NS), dedupe_token="y")
        rows = diagnose_summary(s, "train-1", parse_since("1h"))
        other_tenant = diagnose_summary(s, "train-1", parse_since("1h"), tenant="beta")
        too_late = diagnose_summary(s, "train-1", NOW_NS // 1_000_000 + 3_600_000)
    assert [r["kb_entry"] for r in rows] == ["python_gc_storm", "slow_degraded_link", "unmatched"]
    gc = rows[0]
    assert (gc["windows"], gc["ranks"], gc["rank_list"]) == (4, 3, [1, 2, 3])
    assert gc["best_evidence"]["python_gc_frac"] == 0.3
    assert rows[2]["windows"] == 2 and other_tenant == [] and too_late == []


# ---- the CLI handlers, through their own store -------------------------------------

def _args(*argv):
    p = argparse.ArgumentParser()
    register(p.add_subparsers(dest="command", required=True))
    return p.parse_args(list(argv))


@pytest.fixture
def cfg(tmp_path, kb):
    cfg = config_mod.load(env={}, data_dir=tmp_path, host="node-a")
    ds = [_diag(kb, "cpu_contention_noisy_neighbour", rank=3), _diag(kb, "cpu_contention_noisy_neighbour", rank=4),
          _diag(kb, None, rank=6)]
    with ChdbStore(tmp_path / "chdb") as s:  # where open_store finds it for this data_dir
        s.migrate()
        s.insert("diagnoses", diagnosis_columns(ds, NOW_NS), dedupe_token="seed")
    return cfg


def _log(cfg):
    with ChdbStore(cfg.data_dir / "chdb") as s:
        return s.query("SELECT rank, kb_entry, mode, status, command, evidence_before, evidence_after "
                       "FROM remediation_log ORDER BY ts, rank").as_dicts()


def test_cli_diagnose_prints_ranked_evidence(cfg, capsys):
    from fleetscope.cli.kb import cmd_diagnose
    assert cmd_diagnose(_args("diagnose", "--job", "train-1", "--format", "json"), cfg) == 0
    out = capsys.readouterr().out
    assert out.index("cpu_contention_noisy_neighbour") < out.index("unmatched")
    assert cmd_diagnose(_args("diagnose", "--job", "train-1", "--tenant", "acme"), cfg) == 0
    table = capsys.readouterr().out
    assert "cpu_contention_noisy" in table and "cpu_steal_frac=0.15" in table
    assert cmd_diagnose(_args("diagnose", "--job", "other-job"), cfg) == 0
    assert "no diagnoses for job other-job" in capsys.readouterr().out


def _flag(s, rank: int, role: str, windows: int, host: str = "node-a", first: int = 0) -> None:
    """Anomaly rows as the scorer stores them (streams/scoring.py _store_anomalies), one per window from
    ``first`` windows ago backwards (a rank-window has one role: the table keeps one row per window)."""
    import numpy as np
    starts = [NOW_NS - (first + k) * 1_000_000_000 for k in range(windows)]
    n = len(starts)
    s.insert("anomalies", {
        "tenant": ["acme"] * n, "job": ["train-1"] * n, "host": [host] * n,
        "rank": np.full(n, rank, dtype=np.int32), "window_start": np.array(starts, dtype=np.int64),
        "score": np.full(n, 40.0), "threshold": np.full(n, 25.0), "detectors": [["gmm"]] * n, "role": [role] * n,
        "contributions": [{"cpu_steal_frac": 3.0}] * n, "peer_z": [{}] * n, "feature": [{"cpu_steal_frac": 0.15}] * n,
        "emitted_at": np.full(n, NOW_NS, dtype=np.int64)}, dedupe_token=f"anomalies-{rank}-{role}")


def test_cli_diagnose_json_names_the_culprit_and_every_flagged_ranks_role(cfg, capsys):
    """The JSON keeps its rows and keys (one per KB entry) and adds the job's culprits and every flagged
    rank's role, waiting ones too (they are stored, never diagnosed)."""
    import json

    from fleetscope.cli.kb import cmd_diagnose
    with ChdbStore(cfg.data_dir / "chdb") as s:
        _flag(s, 3, "culprit", 4)
        _flag(s, 4, "waiting", 3)
        _flag(s, 4, "culprit", 1, first=5)
        _flag(s, 5, "waiting", 4, host="node-b")
    assert cmd_diagnose(_args("diagnose", "--job", "train-1", "--format", "json"), cfg) == 0
    rows = json.loads(capsys.readouterr().out)
    cpu = next(r for r in rows if r["kb_entry"] == "cpu_contention_noisy_neighbour")
    assert {"kb_entry", "windows", "ranks", "rank_list", "max_confidence", "best_evidence"} <= set(cpu)
    assert cpu["culprit_ranks"] == [3, 4]
    assert cpu["rank_roles"] == {"3": ["culprit"], "4": ["waiting", "culprit"]}   # most windows first
    assert cpu["flagged_ranks"] == [
        {"rank": 3, "host": "node-a", "role": "culprit", "windows": 4},
        {"rank": 4, "host": "node-a", "role": "waiting", "windows": 3},
        {"rank": 4, "host": "node-a", "role": "culprit", "windows": 1},
        {"rank": 5, "host": "node-b", "role": "waiting", "windows": 4}]
    assert all(r["culprit_ranks"] == [3, 4] and r["flagged_ranks"] == cpu["flagged_ranks"] for r in rows)


def test_cli_remediate_dry_run_by_default_and_logged(cfg, capsys):
    from fleetscope.cli.kb import cmd_remediate
    ex = RecordingExecutor()
    assert cmd_remediate(_args("remediate", "--job", "train-1"), cfg, executor=ex) == 0
    out = capsys.readouterr().out
    assert "[dry_run] cpu_contention_noisy_neighbour on node-a" in out and "would run: kubectl cordon node-a" in out
    assert ex.calls == []
    log = _log(cfg)
    assert [(r["rank"], r["mode"], r["status"]) for r in log] == [(3, "dry_run", "planned"), (4, "dry_run", "planned")]
    assert log[0]["evidence_before"]["cpu_steal_frac"] == "0.15"


def test_cli_remediate_plans_the_remediation_of_the_rule_block_that_held(tmp_path, kb, capsys):
    """Two stored slow_degraded_link diagnoses: rank 1's by one rank's bandwidth and tail latency (the main block,
    NVLink's counters), rank 2's by the ring's wakeups (the `or` block of a TCP link, its sockets). The plan of each
    comes from the rules the store kept as held."""
    from fleetscope.cli.kb import cmd_remediate
    cfg = config_mod.load(env={}, data_dir=tmp_path, host="node-a")
    ds = []
    for rank, case in ((1, CASES["slow_degraded_link"][0][0]), (2, CASES["slow_degraded_link"][0][1])):
        a = anomaly(*case)
        a.rank, a.window_start_ns, a.host = rank, NOW_NS, "node-a"
        ds.append(diagnose(a, kb))
    assert [d.best for d in ds] == ["slow_degraded_link"] * 2
    with ChdbStore(tmp_path / "chdb") as s:
        s.migrate()
        s.insert("diagnoses", diagnosis_columns(ds, NOW_NS), dedupe_token="seed")
    assert cmd_remediate(_args("remediate", "--job", "train-1", "--entry", "slow_degraded_link", "--param", "gpu=0",
                               "--min-confidence", "0"), cfg, executor=RecordingExecutor()) == 0
    assert {(r["rank"], r["command"]) for r in _log(cfg)} == {(1, "nvidia-smi nvlink -e -i 0"),
                                                              (2, "ss -tin state established")}


def test_cli_remediate_execute_needs_both_opt_ins(cfg, capsys):
    from fleetscope.cli.kb import cmd_remediate
    ex = RecordingExecutor()
    cmd_remediate(_args("remediate", "--job", "train-1", "--execute", "--rank", "3",
                        "--allow-entry", "cpu_contention_noisy_neighbour"), cfg, executor=ex)
    assert ex.calls == [] and "host node-a is not opted in" in capsys.readouterr().out
    assert cmd_remediate(_args("remediate", "--job", "train-1", "--execute", "--rank", "3",
                               "--allow-entry", "cpu_contention_noisy_neighbour", "--allow-host", "node-a",
                               "--operator", "alice"), cfg, executor=ex) == 0
    assert ("run", ("kubectl", "cordon", "node-a")) in ex.calls
    log = _log(cfg)
    # the intent is journaled before the command runs, the outcome after it
    assert [(r["mode"], r["status"]) for r in log] == [("refused", "refused"), ("execute", "started"), ("execute", "ok")]
    assert log[2]["evidence_after"]["exit_code"] == "0" and "check" in log[2]["evidence_before"]


def test_cli_kb_list_and_show(capsys, kb):
    from fleetscope.cli.kb import cmd_kb_list, cmd_kb_show
    assert cmd_kb_list(_args("kb", "list"), None) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == len(kb)
    assert cmd_kb_show(_args("kb", "show", "irq_locality_miss"), None) == 0
    out = capsys.readouterr().out
    assert "write '{cpus}' to /proc/irq/{irq}/smp_affinity_list" in out and "parameters: cpus, irq" in out
    assert cmd_kb_show(_args("kb", "show", "slow_degraded_link"), None) == 0   # an `or` block's own remediation
    out = capsys.readouterr().out
    assert "where it held, remediation: ss -tin state established" in out
    assert out.index("ss -tin") < out.index("remediation: nvidia-smi nvlink -e -i {gpu}")
    assert cmd_kb_show(_args("kb", "show", "nope"), None) == 1


def test_parse_since():
    assert parse_since("30m", now_s=10_000) == (10_000 - 1800) * 1000
    assert parse_since("2024-01-02T03:04:05") == 1704164645000
    with pytest.raises(SystemExit, match="--since"):
        parse_since("yesterday")


def test_diagnoser_batch_goes_to_the_store(tmp_path, kb):
    from fleetscope.streams.diagnosis.pipeline import Diagnoser
    good = anomaly(*CASES["xid_hardware_error"][0][0])
    good.window_start_ns = NOW_NS
    as_dict = dict(good.__dict__, rank=9)
    d = Diagnoser(kb)
    out = d.handle([good, as_dict, {"tenant": "t"}, dict(as_dict, bogus=1)], emitted_at_ns=NOW_NS)
    assert len(out.diagnoses) == 2 and out.unmatched == 0 and len(out.rejected) == 2
    assert "lacks fields" in out.rejected[0] and "unknown fields ['bogus']" in out.rejected[1]
    assert d.counts == {"anomalies": 4, "matched": 2, "unmatched": 0, "rejected": 2}
    with _store(tmp_path) as s:
        s.insert("diagnoses", out.columns, dedupe_token="batch-1")
        assert s.query("SELECT groupArray(rank) FROM (SELECT rank FROM diagnoses WHERE kb_entry = "
                       "'xid_hardware_error' ORDER BY rank)").rows[0][0] == [3, 9]
