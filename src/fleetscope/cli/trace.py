"""`fleetscope trace`: a job's last N seconds as a Perfetto / chrome://tracing timeline (Chrome trace JSON).

What it exports today is what the store holds: the traced sources' rows (cuda, nccl, python, torch; sums per
sampling interval, one track per source and rank) and the anomaly windows, plus, with --records, per-call
records that tracers captured in detail mode (JSON lines of {api, pid, tid, ts_ns, dur_ns, ...}). Switching a
running agent's tracers into detail mode from here needs a control channel to the agent that does not exist
yet, so the command does not do that.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from fleetscope.cli.common import load_config, open_configured_store

TRACED = ("cuda", "nccl", "python", "torch")
MAX_ROWS = 500_000

ROWS_SQL = """
SELECT rank, host, source, metric, device, pid, toUnixTimestamp64Nano(ts) AS ts_ns, interval_ns, value, sample_frac
FROM raw_metrics
WHERE job = {job:String} AND ({tenant:String} = '' OR tenant = {tenant:String})
  AND ({rank:Int32} < 0 OR rank = {rank:Int32})
  AND source IN ('cuda', 'nccl', 'python', 'torch')
  AND ts >= (SELECT max(ts) FROM raw_metrics WHERE job = {job:String}) - toIntervalSecond({seconds:UInt32})
ORDER BY rank, ts
LIMIT 500000
"""
ANOMALIES_SQL = """
SELECT rank, host, toUnixTimestamp64Nano(window_start) AS window_start_ns, score, threshold, detectors
FROM anomalies FINAL
WHERE job = {job:String} AND ({tenant:String} = '' OR tenant = {tenant:String})
  AND ({rank:Int32} < 0 OR rank = {rank:Int32})
  AND window_start >= (SELECT max(ts) FROM raw_metrics WHERE job = {job:String}) - toIntervalSecond({seconds:UInt32})
ORDER BY window_start
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


def cmd_trace(args) -> int:
    from fleetscope.chrome_trace import ChromeTrace
    params = {"job": args.job, "tenant": args.tenant or "", "rank": args.rank if args.rank is not None else -1,
              "seconds": int(args.seconds)}
    store = open_configured_store(load_config(args))
    try:
        rows = store.read_query(ROWS_SQL, params).as_dicts()
        anomalies = store.read_query(ANOMALIES_SQL, params).as_dicts()
        pids = store.read_query(PIDS_SQL, params).as_dicts() if args.records else []
    finally:
        store.close()
    trace = ChromeTrace()
    n_rows = trace.add_rows(rows)
    n_calls = 0
    if args.records:
        rank_of_pid = {int(p["pid"]): int(p["rank"]) for p in pids
                       if args.rank is None or int(p["rank"]) == args.rank}
        n_calls = trace.add_calls(read_records(args.records), rank_of_pid)
    n_anom = trace.add_anomalies(anomalies)
    if not (n_rows or n_calls or n_anom):
        print(f"fleetscope trace: nothing stored for job {args.job!r} in its last {args.seconds:g} s "
              f"(traced sources: {', '.join(TRACED)}); check the job name with "
              "`fleetscope query \"SELECT DISTINCT tenant, job FROM raw_metrics\"`", file=sys.stderr)
        return 1
    Path(args.out).write_text(json.dumps(trace.to_json(job=args.job, seconds=args.seconds)))
    print(f"wrote {args.out}: {n_rows} interval events, {n_calls} calls, {n_anom} anomaly windows "
          f"(open it in ui.perfetto.dev or chrome://tracing)")
    return 0


def register(sub) -> None:
    p = sub.add_parser("trace", help="export a job's last N seconds as a Perfetto / chrome://tracing timeline")
    p.add_argument("--job", required=True, help="the job to export")
    p.add_argument("--tenant", help="the job's tenant (default: any)")
    p.add_argument("--rank", type=int, help="only this rank (default: all)")
    p.add_argument("--seconds", type=float, default=60.0, help="how far back from the job's newest row (default: 60)")
    p.add_argument("--out", required=True, help="the JSON file to write (Chrome trace event format)")
    p.add_argument("--records", metavar="FILE", help="also per-call records captured in detail mode (JSON lines)")
    p.set_defaults(func=cmd_trace)
