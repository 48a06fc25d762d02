"""Pipeline benchmark (issue 14): the worker, the sink and the whole data path against a minimal
pipeline, in one run, on the embedded stack (tansu, `fleetscope streams` workers, `fleetscope sink`
with chDB; fleetscope.cli.launcher). The parts, one job per module in benchmarks/pipeline/:

- fleet.py: the synthetic fleet (big hosts, node load) and the paced and backlog producers;
- probes.py: CPU/RSS from /proc, the machine's busy share, committed lag, the code measured;
- stack.py: one launcher stack per phase, and the store's rows and latencies;
- drain.py: capacity on a backlog: the sink alone, the minimal pipeline (minimal_bench.py) and one
  worker alone on the same messages; then two workers beside the sink on a fresh backlog;
- e2e_bench.py: worker + sink at stepped paced rates (zero loss, raw and feature row latencies);
- ranks_bench.py / ranks.py: ranks one worker scores at 1 s windows with step p99 <= 0.5 s.

Writes benchmarks/results/pipeline.json with the issue's keys, measured; a goal not reached says so.
Every process started here is stopped on exit, error or Ctrl-C.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

from fleetscope import config as config_mod
from fleetscope.broker import EmbeddedBroker

from pipeline import drain, e2e_bench, ranks_bench
from pipeline.probes import ROOT, code_state
from pipeline.stack import log

GOALS = {"worker_events_per_s": 1_000_000, "sink_rows_per_s": 1_000_000, "ratio_to_minimal_pipeline": 0.5,
         "raw_row_p99_s": 2.0, "feature_row_p99_s": 3.0, "kafka_bytes_per_event": 12.0,
         "ranks_per_worker_at_1s": 2000}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=1320.0,
                    help="the run's time budget; no phase step starts that would not fit (default %(default)s)")
    ap.add_argument("--parts", default="drain,two_workers,ranks,e2e", help="phases to run, comma-separated")
    ap.add_argument("--hosts", type=int, default=32, help="simulated hosts (each its own job key)")
    ap.add_argument("--events-per-batch", type=int, default=2000, help="events per Kafka message (one host tick)")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--window-s", type=float, default=1.0)
    ap.add_argument("--backlog-events", type=int, default=8_000_000, help="events in each drain phase's backlog")
    ap.add_argument("--density", type=float, default=1_000_000,
                    help="the backlog's event times are spread as a live fleet at this many events/s")
    ap.add_argument("--minimal-poll-messages", type=int, default=500, help="messages per minimal-pipeline insert")
    ap.add_argument("--rates", default="100000,200000,300000,450000,650000,1000000",
                    help="paced end-to-end steps, events/s (default: %(default)s)")
    ap.add_argument("--step-s", type=float, default=15.0, help="seconds of production per paced step")
    ap.add_argument("--warmup-s", type=float, default=2.0)
    ap.add_argument("--keep-up-s", type=float, default=5.0,
                    help="a step keeps up when the worker's events_in reaches the acked count this soon after stop")
    ap.add_argument("--max-lag-growth", type=float, default=0.1,
                    help="a step fails when the backlog grows faster than this fraction of the rate (fitted)")
    ap.add_argument("--abort-lag-s", type=float, default=8.0, help="stop producing once this many seconds behind")
    ap.add_argument("--max-drain-s", type=float, default=90.0, help="give up waiting for a backlog after this")
    ap.add_argument("--refine", type=int, default=1, help="midpoint steps between the last pass and first fail")
    ap.add_argument("--feature-poll-s", type=float, default=0.25, help="how often stored feature rows are looked for")
    ap.add_argument("--ranks", default="250,500,1000,1500,2000,3000", help="ranks steps (stops at the first over the p99)")
    ap.add_argument("--ranks-p99-s", type=float, default=0.5)
    ap.add_argument("--ranks-windows", type=int, default=24)
    ap.add_argument("--ranks-warmup", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pipeline.json"))
    ap.add_argument("--keep-data", action="store_true", help="keep the temp data dirs (logs, chDB)")
    ap.add_argument("--profile-worker", metavar="PATH",
                    help="run workers under cProfile, writing PATH.<stack> (slows them: diagnosis only)")
    return ap.parse_args(argv)


def headline(result: dict) -> dict:
    """The issue's keys, from the phases' measured numbers (None where a phase did not run or reach it)."""
    d = result.get("drain") or {}
    w, s, m = d.get("worker") or {}, d.get("sink") or {}, d.get("minimal") or {}
    two = result.get("two_workers") or {}
    e2e = result.get("e2e") or {}
    best = e2e.get("best_sustained_step") or {}
    keys = {
        "worker_events_per_s": w.get("events_per_s") if w.get("zero_loss") else None,
        "sink_rows_per_s": s.get("events_per_s") if s.get("zero_loss") else None,
        "minimal_pipeline_events_per_s": m.get("events_per_s"),
        "end_to_end_events_per_s": best.get("produced_events_per_s"),
        "raw_row_p99_s": ((best.get("event_to_raw_row_ms") or {}).get("p99") or 0) / 1000 if best else None,
        "feature_row_p99_s": (((best.get("event_at_window_start_to_stored_feature_row_ms") or {}).get("p99") or 0)
                              / 1000 if best else None),
        "kafka_bytes_per_event": (d.get("backlog") or {}).get("kafka_bytes_per_event"),
        "two_workers_events_per_s": two.get("events_per_s") if two.get("zero_loss") else None,
        "ranks_per_worker_at_1s": (result.get("ranks") or {}).get("ranks_per_worker_at_1s"),
        "worker_rss_mb_at_ranks_load": (result.get("ranks") or {}).get("worker_rss_mb_at_that_load"),
    }
    keys["ratio_to_minimal_pipeline"] = (round(keys["end_to_end_events_per_s"] / keys["minimal_pipeline_events_per_s"], 3)
                                         if keys["end_to_end_events_per_s"] and keys["minimal_pipeline_events_per_s"]
                                         else None)
    keys["two_workers_over_one"] = (round(keys["two_workers_events_per_s"] / keys["worker_events_per_s"], 3)
                                    if keys["two_workers_events_per_s"] and keys["worker_events_per_s"] else None)
    met = {}
    for k, goal in GOALS.items():
        v = keys.get(k)
        if v is None:
            met[k] = None  # not measured in this run
        elif k in ("raw_row_p99_s", "feature_row_p99_s", "kafka_bytes_per_event"):
            met[k] = v <= goal
        else:
            met[k] = v >= goal
    return {"keys": keys, "goals": GOALS, "goals_met": met}


def main(argv=None) -> int:
    args = parse_args(argv)
    parts = set(args.parts.split(","))
    deadline = time.monotonic() + args.budget_s
    defaults = config_mod.load(env={})
    args.lateness_s, args.idle_close_s = defaults.allowed_lateness_s, defaults.idle_close_s
    run_id = f"pb{uuid.uuid4().hex[:6]}"

    def on_term(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)

    result: dict = {"benchmark": "pipeline", "command": " ".join(["python", *sys.argv]),
                    "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "machine": {"nproc": os.cpu_count(), "python": platform.python_version(),
                                "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]},
                    "code_at_start": code_state(),
                    "config": {k: v for k, v in vars(args).items() if k not in ("out",)}}
    chdb_dir = Path(tempfile.mkdtemp(prefix="fs-pipeline-bench-minimal-"))
    t_start = time.monotonic()
    try:
        if "drain" in parts:
            result["drain"] = drain.sink_and_worker(args, run_id, chdb_dir)
            result["loadavg_after_drain"] = [round(x, 2) for x in os.getloadavg()]
        if "two_workers" in parts:
            result["two_workers"] = drain.two_workers(args, run_id)
            result["loadavg_after_two_workers"] = [round(x, 2) for x in os.getloadavg()]
        if "ranks" in parts:
            broker = EmbeddedBroker(log_path=chdb_dir / "ranks-broker.log").start()
            try:
                result["ranks"] = ranks_bench.step_ranks(args, broker.bootstrap, run_id, deadline)
            finally:
                broker.stop()
            result["loadavg_after_ranks"] = [round(x, 2) for x in os.getloadavg()]
        if "e2e" in parts:
            rates = [float(r) for r in args.rates.split(",") if r.strip()]
            steps, out_of_time = e2e_bench.step_up(args, run_id, rates, deadline)
            passed = [s for s in steps if s["sustained"]]
            result["e2e"] = {"steps": steps, "stopped_by_budget": out_of_time,
                             "best_sustained_step": max(passed, key=lambda s: s["produced_events_per_s"], default=None),
                             "lowest_failing_target": min((s["target_events_per_s"] for s in steps
                                                           if not s["sustained"]), default=None)}
    finally:
        import shutil
        shutil.rmtree(chdb_dir, ignore_errors=True)
    result.update(headline(result))
    result["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    result["code_at_end"] = code_state()
    result["code_changed_during_run"] = result["code_at_end"] != result["code_at_start"]
    result["elapsed_s"] = round(time.monotonic() - t_start, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"keys {json.dumps(result['keys'])}")
    log(f"goals met {json.dumps(result['goals_met'])}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
