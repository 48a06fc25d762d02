"""The saved queries of sql/queries/ (the SQL cookbook) run against real chDB with the migrated schema and rows
inserted through the store's own insert path, and find what those rows hold. They are installed with the
package, listed in the README, and run through `fleetscope query --file`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleetscope.resources import package_dir
from fleetscope.store import open_store
from support.store_samples import insert_sample_fleet

QUERIES = package_dir("fleetscope.sql") / "queries"
COOKBOOK = ("top_slow_ranks", "energy_per_job", "ofu_over_time", "tenant_anomalies", "diagnoses_by_kb_entry",
            "dlq_by_reason")
README = Path(__file__).resolve().parents[1] / "README.md"


def run_saved(store, name: str, **params):
    return store.read_query((QUERIES / f"{name}.sql").read_text(), {k: str(v) for k, v in params.items()}).as_dicts()


@pytest.fixture()
def fleet(store):
    return insert_sample_fleet(store)


def test_every_cookbook_query_is_installed_and_listed_in_the_readme():
    readme = README.read_text()
    for name in COOKBOOK:
        assert (QUERIES / f"{name}.sql").is_file(), f"{name}.sql is not installed with fleetscope.sql"
        assert f"sql/queries/{name}.sql" in readme, f"the README's SQL cookbook does not list {name}.sql"


def test_top_slow_ranks_puts_the_straggler_first(store, fleet):
    rows = run_saved(store, "top_slow_ranks", tenant="acme", job="train-1", hours=1)
    assert [r["rank"] for r in rows][0] == fleet.facts["straggler"]
    assert rows[0]["flagged_windows"] == fleet.facts["flagged"] and rows[0]["windows"] == 10
    assert all(r["flagged_windows"] == 0 for r in rows[1:]) and len(rows) == 4  # the waiting peer is not flagged
    assert {r["rank"]: r["waiting_windows"] for r in rows} == {
        r["rank"]: fleet.facts["flagged"] if r["rank"] == fleet.facts["waiting"] else 0 for r in rows}
    assert rows[0]["mean_nccl_time_frac"] < rows[1]["mean_nccl_time_frac"]  # the straggler waits least


def test_energy_per_job_sums_each_jobs_rank_windows(store, fleet):
    rows = run_saved(store, "energy_per_job", hours=1)
    got = {(r["tenant"], r["job"]): r["energy_j"] for r in rows}
    assert got == pytest.approx(fleet.facts["energy_j"])
    assert "_node" not in {r["tenant"] for r in rows}  # device energy is not a job's


def test_ofu_over_time_gives_each_nodes_ofu_per_bucket(store, fleet):
    rows = run_saved(store, "ofu_over_time", hours=1, bucket_s=60)
    assert {r["host"]: r["ofu_percent"] for r in rows} == fleet.facts["ofu"]
    assert len(rows) == 2 * 10  # one bucket per window and host


def test_tenant_anomalies_lists_only_that_tenants_flags_with_top_features(store, fleet):
    rows = run_saved(store, "tenant_anomalies", tenant="acme", hours=1)
    assert len(rows) == fleet.facts["flagged"] and {r["rank"] for r in rows} == {fleet.facts["straggler"]}
    assert {r["role"] for r in rows} == {"culprit"}  # not the peer that waits on it
    assert rows[0]["top_features"] == "nccl_time_frac, cpu_busy_frac, gpu_util"
    assert rows[0]["window_start"] > rows[-1]["window_start"]  # newest first
    assert run_saved(store, "tenant_anomalies", tenant="beta", hours=1) == []


def test_diagnoses_by_kb_entry_counts_windows_per_entry(store, fleet):
    rows = run_saved(store, "diagnoses_by_kb_entry", hours=1)
    assert {r["kb_entry"]: r["windows"] for r in rows} == fleet.facts["kb"]


def test_dlq_by_reason_counts_messages_per_reason_and_topic(store, fleet):
    rows = run_saved(store, "dlq_by_reason", hours=1)
    assert {(r["reason"], r["topic"]): r["messages"] for r in rows} == fleet.facts["dlq"]


def test_fleetscope_query_file_runs_a_saved_query(tmp_path):
    """The CLI path: `fleetscope query --file X.sql --param ...` in its own process (chDB opens a data
    directory in one process at a time, so the test's store is closed first)."""
    store = open_store(tmp_path, clickhouse_url=None, prefer_endpoint=False)
    store.migrate()
    fleet = insert_sample_fleet(store)
    store.close()
    env = {**os.environ, "FLEETSCOPE_DATA_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "fleetscope", "query", "--file", str(QUERIES / "energy_per_job.sql"),
                          "--param", "hours=1", "--format", "json"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    got = {(r["tenant"], r["job"]): r["energy_j"] for r in json.loads(out.stdout)}
    assert got == pytest.approx(fleet.facts["energy_j"])
    both = subprocess.run([sys.executable, "-m", "fleetscope", "query", "SELECT 1", "--file", "x.sql"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert both.returncode != 0 and "not both or neither" in both.stderr
