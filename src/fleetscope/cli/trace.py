"""`fleetscope trace`: a job's last N seconds as a Perfetto / chrome://tracing timeline (Chrome trace JSON).

What it exports is what the store holds: the traced sources' rows (cuda, nccl, python, torch; sums per
sampling interval, one track per source and rank), the anomaly windows, and the calls in `trace_events`: the
per-call records agents with `trace_capture_s` set captured around anomalies of their ranks (producers/
trace_capture.py), one complete event per call with its measured duration. With --records it also takes
per-call records from a file (JSON lines of {api, pid, tid, ts_ns, dur_ns, ...}). "The last N seconds" end at
the job's newest row in raw_metrics or trace_events. With --anomaly ID (TENANT/JOB/RANK/WINDOW_START_NS, as
alerts carry it) it exports that rank around that window instead: the window ± one window (`window_s`), which
is what a capture around it holds.

Not done here: switching a running agent's tracers into detail mode for N seconds needs a control channel to
the agent that does not exist yet, so the command does not do that; calls are on the timeline only where an
agent captured them around an anomaly (or a --records file has them).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from fleetscope.anomaly_id import parse_anomaly_id
from fleetscope.cli.common import load_config, open_configured_store

TRACED = ("cuda", "nccl", "python", "torch")
MAX_ROWS = 500_000

END_SQL = """
SELECT greatest(
    (SELECT toUnixTimestamp64Nano(max(ts)) FROM raw_metrics
     WHERE job = {job:String} AND ({tenant:String} = '' OR tenant = {tenant:String})),
    (SELECT toUnixTimestamp64Nano(max(ts)) FROM trace_events
     WHERE job = {job:String} AND ({tenant:String} = '' OR tenant = {tenant:String}))) AS end_ns
"""
ROWS_SQL = """
SELECT rank, host, source, metric, device, pid, toUnixTimestamp64Nano(ts) AS ts_ns, interval_ns, value, sample_frac
FROM raw_metrics
WHERE job = {job:String} AND ({tenant:String} = '' OR tenant = {tenant:String})
  AND ({rank:Int32} < 0 OR rank = {rank:Int32})
  AND source IN ('cuda', 'nccl', 'python', 'torch')
  AND ts >= fromUnixTimestamp64Nano({since_ns:Int64}) AND ts < fromUnixTimestamp64Nano({until_ns:Int64})
ORDER BY rank, ts
LIMIT 500000
"""
ANOMALIES_SQL = """
SELECT rank, host, toUnixTimestamp64Nano(window_start) AS window_start_ns, score, threshold, detectors
FROM anomalies FINAL
WHERE job = {job:String} AND ({tenant:String} = '' OR tenant = {tenant:String})
  AND ({rank:Int32} < 0 OR rank = {rank:Int32})
  AND window_start >= fromUnixTimestamp64Nano({since_ns:Int64})
  AND window_start < fromUnixTimestamp64Nano({until_ns:Int64})
ORDER BY window_start
"""
CALLS_SQL = """
SELECT rank, host, source, api, pid, tid, toUnixTimestamp64Nano(ts) AS ts_ns, dur_ns, args
FROM trace_events FINAL
WHERE job = {job:String} AND ({tenant:String} = '' OR tenant = {tenant:String})
  AND ({rank:Int32} < 0 OR rank = {rank:Int32})
  AND ts >= fromUnixTimestamp64Nano({since_ns:Int64}) AND ts < fromUnixTimestamp64Nano({until_ns:Int64})
ORDER BY rank, ts
LIMIT 500000
"""
ANOMALY_SQL = """
SELECT count() AS n FROM anomalies FINAL
WHERE tenant = {tenant:String} AND job = {job:String} AND rank = {rank:Int32}
  AND window_start = fromUnixTimestamp64Nano({window_ns:Int64})
"""
PIDS_SQL = """
SELECT DISTINCT pid, rank, host FROM raw_metrics
WHERE job = {job:String} AND ({tenant:String} = '' OR tenant = {tenant:String}) AND pid > 0 AND rank >= 0
"""


def read_records(path: str) -> list[dict]:
    out = []
    with open(path) as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except ValueError as exc:
                    raise SystemExit(f"fleetscope trace: {path} line {n} is not JSON ({exc}); "
                                     f"give one per-call record per line")
    return out


def add_stored_calls(trace, calls: list[dict]) -> int:
    """trace_events rows on the timeline: each (rank, host, tracer)'s calls through ChromeTrace.add_calls."""
    groups: dict[tuple, list[dict]] = {}
    for c in calls:
        record = {**json.loads(c["args"] or "{}"), "api": c["api"], "pid": int(c["pid"]), "tid": int(c["tid"]),
                  "ts_ns": int(c["ts_ns"]), "dur_ns": int(c["dur_ns"])}
        groups.setdefault((int(c["rank"]), str(c["host"]), str(c["source"])), []).append(record)
    return sum(trace.add_calls(records, {r["pid"]: rank for r in records}, host=host, source=source)
               for (rank, host, source), records in groups.items())


def anomaly_span(anomaly_id: str, window_s: float) -> dict:
    """--anomaly: the query parameters of its rank, its window ± one window; SystemExit if the id is malformed."""
    try:
        aid = parse_anomaly_id(anomaly_id)
    except ValueError as exc:
        raise SystemExit(f"fleetscope trace: {exc}") from None
    window_ns = int(window_s * 1e9)
    return {"job": aid.job, "tenant": aid.tenant, "rank": aid.rank, "window_ns": aid.window_start_ns,
            "since_ns": aid.window_start_ns - window_ns, "until_ns": aid.window_start_ns + 2 * window_ns}


def cmd_trace(args) -> int:
    from fleetscope.chrome_trace import ChromeTrace
    cfg = load_config(args)
    if args.anomaly:
        params, seconds = anomaly_span(args.anomaly, cfg.window_s), 3 * cfg.window_s
    else:
        params = {"job": args.job, "tenant": args.tenant or "", "rank": args.rank if args.rank is not None else -1}
        seconds = args.seconds
    job, rank = params["job"], (params["rank"] if params["rank"] >= 0 else None)
    store = open_configured_store(cfg)
    try:
        if args.anomaly:
            if not int(store.read_query(ANOMALY_SQL, params).as_dicts()[0]["n"]):
                print(f"fleetscope trace: no anomaly {args.anomaly} in the store; list them with `fleetscope query "
                      "\"SELECT tenant, job, rank, toUnixTimestamp64Nano(window_start) FROM anomalies\"`",
                      file=sys.stderr)
                return 1
        else:
            end_ns = int(store.read_query(END_SQL, params).as_dicts()[0]["end_ns"])
            params["since_ns"], params["until_ns"] = end_ns - int(seconds * 1e9), end_ns + 1
        rows = store.read_query(ROWS_SQL, params).as_dicts()
        anomalies = store.read_query(ANOMALIES_SQL, params).as_dicts()
        calls = store.read_query(CALLS_SQL, params).as_dicts()
        pids = store.read_query(PIDS_SQL, params).as_dicts() if args.records else []
    finally:
        store.close()
    trace = ChromeTrace()
    n_rows = trace.add_rows(rows)
    n_calls = add_stored_calls(trace, calls)
    if args.records:
        rank_of_pid = {int(p["pid"]): int(p["rank"]) for p in pids
                       if rank is None or int(p["rank"]) == rank}
        n_calls += trace.add_calls(read_records(args.records), rank_of_pid)
    n_anom = trace.add_anomalies(anomalies)
    if not (n_rows or n_calls or n_anom):
        print(f"fleetscope trace: nothing stored for job {job!r} in its last {seconds:g} s "
              f"(traced sources: {', '.join(TRACED)}); check the job name with "
              "`fleetscope query \"SELECT DISTINCT tenant, job FROM raw_metrics\"`", file=sys.stderr)
        return 1
    Path(args.out).write_text(json.dumps(trace.to_json(job=job, seconds=seconds)))
    print(f"wrote {args.out}: {n_rows} interval events, {n_calls} calls, {n_anom} anomaly windows "
          f"(open it in ui.perfetto.dev or chrome://tracing)")
    return 0


def register(sub) -> None:
    p = sub.add_parser("trace", help="export a job's last N seconds as a Perfetto / chrome://tracing timeline")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--job", help="the job to export")
    which.add_argument("--anomaly", metavar="ID", help="export one anomaly's rank, its window ± one window: "
                       "TENANT/JOB/RANK/WINDOW_START_NS, as alerts carry it (annotation anomaly_id)")
    p.add_argument("--tenant", help="the job's tenant (default: any)")
    p.add_argument("--rank", type=int, help="only this rank (default: all)")
    p.add_argument("--seconds", type=float, default=60.0, help="how far back from the job's newest row (default: 60)")
    p.add_argument("--out", required=True, help="the JSON file to write (Chrome trace event format)")
    p.add_argument("--records", metavar="FILE", help="also per-call records captured in detail mode (JSON lines)")
    p.set_defaults(func=cmd_trace)
