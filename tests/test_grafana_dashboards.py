"""The Grafana dashboards (deploy/grafana/dashboards/) use the official ClickHouse datasource, every panel's and
variable's SQL is exactly the text of a file in sql/queries/, and every one of those queries, with the plugin's
macros and the dashboard variables expanded, runs on real chDB with the migrated schema and rows inserted
through the store's own insert path, and finds those rows. No Grafana runs here (none is installed); what
Grafana itself would do with the JSON is not checked beyond its structure."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from fleetscope.resources import package_dir
from support.grafana_macros import expand
from support.store_samples import insert_sample_fleet

GRAFANA = Path(__file__).resolve().parents[1] / "deploy" / "grafana"
QUERIES = package_dir("fleetscope.sql") / "queries"
PLUGIN = "grafana-clickhouse-datasource"
VALUES = {"tenant": "acme", "job": "train-1", "host": "h1"}


def dashboards() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((GRAFANA / "dashboards").glob("*.json"))}


def sql_uses() -> list[tuple[str, str, str]]:
    """(dashboard, where, SQL) of every panel target and query variable."""
    uses = []
    for name, d in dashboards().items():
        for p in d["panels"]:
            for t in p["targets"]:
                uses.append((name, f"panel {p['title']!r}: {p['description']}", t["rawSql"]))
        for v in d["templating"]["list"]:
            if v["type"] == "query":
                uses.append((name, f"variable {v['name']}: {v['description']}", v["query"]["rawSql"]))
    return uses


def test_the_three_dashboards_exist_and_use_the_clickhouse_plugin():
    ds = dashboards()
    assert set(ds) == {"fleet", "job", "node"}
    for name, d in ds.items():
        assert d["panels"], name
        for p in d["panels"]:
            assert p["datasource"]["type"] == PLUGIN and all(t["datasource"]["type"] == PLUGIN for t in p["targets"])
        assert {"datasource"} <= {v["name"] for v in d["templating"]["list"]}
    assert {v["name"] for v in ds["job"]["templating"]["list"]} >= {"tenant", "job"}
    assert {v["name"] for v in ds["node"]["templating"]["list"]} >= {"host"}


def test_every_dashboard_query_is_the_text_of_its_sql_file():
    used = set()
    for dashboard, where, sql in sql_uses():
        stem = re.search(r"SQL: sql/queries/(\w+)\.sql", where)
        assert stem, f"{dashboard} {where} names no sql/queries file"
        assert sql == (QUERIES / f"{stem[1]}.sql").read_text(), (
            f"{dashboard} {where} differs from its file: run deploy/grafana/render_dashboards.py")
        used.add(stem[1])
    prefixed = {p.stem for p in QUERIES.glob("*.sql") if p.stem.split("_")[0] in {"fleet", "job", "node", "var"}}
    assert prefixed == used, f"dashboard query files no dashboard uses: {sorted(prefixed - used)}"


def test_dashboard_provisioning_points_grafana_at_a_folder():
    doc = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "fleetscope.yaml").read_text())
    provider = doc["providers"][0]
    assert doc["apiVersion"] == 1 and provider["type"] == "file" and provider["options"]["path"]


@pytest.fixture()
def fleet(store):
    return insert_sample_fleet(store)


def run_expanded(store, fleet, sql: str):
    text = expand(sql, from_s=fleet.first_ns // 10**9 - 60, to_s=fleet.last_ns // 10**9 + 60, interval_s=60,
                  variables=VALUES)
    return store.read_query(text).as_dicts()


@pytest.mark.parametrize("dashboard,where,sql", sql_uses(), ids=lambda v: v if len(v) < 40 else None)
def test_every_dashboard_query_runs_on_chdb_and_finds_the_sample_rows(store, fleet, dashboard, where, sql):
    rows = run_expanded(store, fleet, sql)
    assert rows, f"{dashboard} {where} found nothing in the sample fleet"


def test_panel_queries_return_what_the_sample_fleet_holds(store, fleet):
    def rows(stem):
        return run_expanded(store, fleet, (QUERIES / f"{stem}.sql").read_text())

    by_job = rows("fleet_anomalies_by_job")
    assert sum(r["anomalies"] for r in by_job) == fleet.facts["flagged"] and {r["job"] for r in by_job} == {"acme/train-1"}
    assert {r["kb_entry"]: r["windows"] for r in rows("fleet_anomalies_by_kb_entry")} == fleet.facts["kb"]
    nodes = rows("fleet_nodes_with_anomalies")
    assert [(r["host"], r["anomalies"], r["flagged_ranks"]) for r in nodes] == [("h1", fleet.facts["flagged"], 1)]
    assert {r["host"]: r["ofu_percent"] for r in rows("fleet_ofu")} == fleet.facts["ofu"]
    kwh = {r["job"]: r["energy_kwh"] for r in rows("fleet_energy_by_job")}
    assert kwh == pytest.approx({f"{t}/{j}": e / 3.6e6 for (t, j), e in fleet.facts["energy_j"].items()})
    scores = rows("job_rank_scores")
    assert {r["rank"] for r in scores} == {"rank 0", "rank 1", "rank 2", "rank 3"} and len(scores) == 4 * 10
    flagged = rows("job_flagged_windows")  # every flagged window, the waiting peer's too, each with its role
    assert len(flagged) == 2 * fleet.facts["flagged"]
    assert {(r["rank"], r["role"]) for r in flagged} == {(fleet.facts["straggler"], "culprit"),
                                                          (fleet.facts["waiting"], "waiting")}
    culprit = [r for r in flagged if r["role"] == "culprit"]
    assert culprit[0]["top_features"].startswith("nccl_time_frac")
    diag = rows("job_diagnoses")
    assert len(diag) == fleet.facts["flagged"] and "cpu_busy_frac=0.97" in diag[0]["evidence"]
    steps = rows("job_step_rate")
    assert min(r["collectives_per_s"] for r in steps if r["rank"] == "rank 2") == 5.0
    gpu = {r["name"] for r in rows("node_gpu_features")}
    assert gpu == {"gpu_util", "gpu_power_w", "gpu_energy_j", "gpu_ofu", "gpu_throttled"}


def test_a_quote_in_a_variable_stays_inside_its_string(store, fleet):
    """${job:sqlstring} quotes the value: a job named with a quote matches nothing instead of changing the SQL."""
    text = expand((QUERIES / "job_flagged_windows.sql").read_text(), 0, 2**31, 60,
                  {"tenant": "acme", "job": "x' OR '1'='1"})
    assert store.read_query(text).rows == []
