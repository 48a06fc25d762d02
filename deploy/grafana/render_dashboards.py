"""Write deploy/grafana/dashboards/*.json from the panel list below and the SQL in sql/queries/.

Each panel's SQL is the text of one saved query, copied verbatim into the dashboard (Grafana cannot read a
file), so the query files stay the one place to edit: change a .sql file, run
`.venv/bin/python deploy/grafana/render_dashboards.py`, commit both. tests/test_grafana_dashboards.py fails
when a dashboard's SQL and its file differ.

Datasource: the official ClickHouse plugin (grafana-clickhouse-datasource 4.x), chosen through a `datasource`
variable so the dashboards work with whatever uid a deployment provisions (ours: fleetscope-clickhouse).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from fleetscope.resources import package_dir

PLUGIN = "grafana-clickhouse-datasource"
DATASOURCE = {"type": PLUGIN, "uid": "${datasource}"}
QUERIES = package_dir("fleetscope.sql") / "queries"
OUT = Path(__file__).resolve().parent / "dashboards"
FORMAT = {"timeseries": 0, "table": 1}  # the plugin's Format enum: TIME_SERIES = 0, TABLE = 1

# dashboard uid -> (title, variables, [(panel title, query file stem, panel type, width, description)])
DASHBOARDS = {
    "fleetscope-fleet": ("fleetscope: fleet overview", (), [
        ("Anomalies by tenant/job", "fleet_anomalies_by_job", "timeseries", 12,
         "Flagged rank-windows per tenant/job."),
        ("Anomalies by KB entry", "fleet_anomalies_by_kb_entry", "table", 12,
         "Anomalous windows per knowledge-base entry and tenant; 'unmatched' when nothing fits."),
        ("Nodes with anomalies", "fleet_nodes_with_anomalies", "table", 12,
         "Nodes whose ranks were flagged, and their GPU-throttled windows."),
        ("OFU per node", "fleet_ofu", "timeseries", 12, "Overall FLOP utilization (%), GPM GPUs only."),
        ("GPU energy per job", "fleet_energy_by_job", "bargauge", 24, "kWh in the dashboard's range."),
    ]),
    "fleetscope-job": ("fleetscope: job", ("tenant", "job"), [
        ("Score and threshold per rank", "job_rank_scores", "timeseries", 24,
         "The job model's score of each rank's windows and the threshold in force."),
        ("Flagged windows", "job_flagged_windows", "table", 12,
         "Flagged windows with the detectors that fired and the top contributing features."),
        ("Diagnoses", "job_diagnoses", "table", 12, "KB entries matched, with rules held and evidence."),
        ("Step rate (collectives per second)", "job_step_rate", "timeseries", 24,
         "Collectives per second per rank: moves with the step rate."),
    ]),
    "fleetscope-node": ("fleetscope: node", ("host",), [
        ("Host features", "node_host_features", "timeseries", 24, "CPU, memory, NUMA and scheduling."),
        ("GPU features", "node_gpu_features", "timeseries", 24, "Utilization, power, energy, OFU, throttling."),
    ]),
}
VARIABLES = {"tenant": "var_tenants", "job": "var_jobs", "host": "var_hosts"}


def sql(stem: str) -> str:
    return (QUERIES / f"{stem}.sql").read_text()


def panel(i: int, y: int, x: int, title: str, stem: str, kind: str, width: int, description: str) -> dict:
    fmt = "timeseries" if kind == "timeseries" else "table"
    return {
        "id": i, "type": kind, "title": title, "datasource": DATASOURCE,
        "description": f"{description} SQL: sql/queries/{stem}.sql",
        "gridPos": {"h": 9, "w": width, "x": x, "y": y},
        "targets": [{"refId": "A", "datasource": DATASOURCE, "editorType": "sql", "queryType": fmt,
                     "format": FORMAT[fmt], "rawSql": sql(stem)}],
    }


def variable(name: str) -> dict:
    return {"name": name, "type": "query", "datasource": DATASOURCE, "refresh": 2, "sort": 1,
            "description": f"SQL: sql/queries/{VARIABLES[name]}.sql",
            "definition": sql(VARIABLES[name]), "query": {"rawSql": sql(VARIABLES[name]), "editorType": "sql"}}


def dashboard(uid: str) -> dict:
    title, variables, panels = DASHBOARDS[uid]
    out, x, y = [], 0, 0
    for i, (ptitle, stem, kind, width, desc) in enumerate(panels, start=1):
        if x + width > 24:
            x, y = 0, y + 9
        out.append(panel(i, y, x, ptitle, stem, kind, width, desc))
        x += width
    templating = [{"name": "datasource", "type": "datasource", "query": PLUGIN, "label": "ClickHouse"}]
    templating += [variable(v) for v in variables]
    return {"uid": uid, "title": title, "tags": ["fleetscope"], "schemaVersion": 39, "editable": True,
            "time": {"from": "now-6h", "to": "now"}, "refresh": "30s",
            "templating": {"list": templating}, "panels": out}


def main() -> int:
    OUT.mkdir(exist_ok=True)
    for uid in DASHBOARDS:
        path = OUT / f"{uid.removeprefix('fleetscope-')}.json"
        path.write_text(json.dumps(dashboard(uid), indent=2) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
