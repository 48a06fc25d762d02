"""`fleetscope trace`: a job's last N seconds as a Perfetto / chrome://tracing timeline (Chrome trace JSON).

What it exports is what the store holds: the traced sources' rows (cuda, nccl, python, torch; sums per
sampling interval, one track per source and rank), the anomaly windows, and the calls in `trace_events`: the
per-call records agents with `trace_capture_s` set captured around anomalies of their ranks (producers/
trace_capture.py), one complete event per call with its measured duration. With --records it also takes
per-call records from a file (JSON lines of {api, pid, tid, ts_ns, dur_ns, ...}). "The last N seconds" end at
the job's newest row in raw_metrics or trace_events. With --anomaly ID (TENANT/JOB/RANK/WINDOW_START_NS, as
alerts carry it) it exports that rank around that window instead: the window ± one window (`window_s`), which
is what a capture around it holds.

With --live it asks the agents for the job's next N seconds instead: it publishes a capture request
(fleetscope/capture_request.py) for [now, now + N] on `<prefix>.control`, waits for the span to end, polls the
store until trace_events holds calls the agents captured for this request (or N + 30 s have passed), and
exports them: a capture around an anomaly of the job, or another request's for the same job, in the same span
is neither counted nor exported (trace_events.request_id).
Agents with `trace_capture_s > 0` answer, from the calls they keep anyway; each publishes the span in pieces of
at most half its ring (producers/trace_capture.py).

Agents with trace_capture_s > 0 answer: their tracers' per-call records are on for the whole run
(trace_capture_anomalies, the default), or switched on by the request for its span (trace_capture_anomalies
off). An agent with trace_capture_s = 0 has no detail mode and answers no request (the command then says so
after its deadline).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from fleetscope.anomaly_id import parse_anomaly_id
from fleetscope.capture_request import CaptureRequestError, build_request, publish_request
from fleetscope.cli.common import kafka_or_explain, load_config, open_configured_store

TRACED = ("cuda", "nccl", "python", "torch")
MAX_ROWS = 500_000
LIVE_GRACE_S = 30.0  # --live: how long after the span's end the store may take to hold its calls
LIVE_POLL_S = 0.5

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
CALLS_WHERE = """
FROM trace_events FINAL
WHERE job = {job:String} AND ({tenant:String} = '' OR tenant = {tenant:String})
  AND ({rank:Int32} < 0 OR rank = {rank:Int32})
  AND ts >= fromUnixTimestamp64Nano({since_ns:Int64}) AND ts < fromUnixTimestamp64Nano({until_ns:Int64})
  AND ({request_id:String} = '' OR request_id = {request_id:String})
"""
CALLS_SQL = """
SELECT rank, host, source, api, pid, tid, toUnixTimestamp64Nano(ts) AS ts_ns, dur_ns, args""" + CALLS_WHERE + """\
ORDER BY rank, ts
LIMIT 500000
"""
CALLS_COUNT_SQL = "SELECT count() AS n" + CALLS_WHERE
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
    cfg = load_config(args)
    if args.live:
        return live_trace(args, cfg)
    if args.anomaly:
        params, seconds = anomaly_span(args.anomaly, cfg.window_s), 3 * cfg.window_s
    else:
        params, seconds = job_params(args), args.seconds
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
        stored = read_stored(store, params, args.records)
    finally:
        store.close()
    return write_trace(args, params, seconds, stored)


def job_params(args) -> dict:
    return {"job": args.job, "tenant": args.tenant or "", "rank": args.rank if args.rank is not None else -1}


def calls_params(params: dict) -> dict:
    """`params` for CALLS_SQL and CALLS_COUNT_SQL: their request_id, if any, takes only the calls captured for that
    live request; without one (or '') the calls of any capture."""
    return {"request_id": "", **params}


def read_stored(store, params: dict, with_pids: bool) -> dict:
    """What the timeline takes from the store for `params` (job, tenant, rank, since_ns, until_ns, and
    request_id: the calls of that live capture request only; '' for those of any capture)."""
    return {"rows": store.read_query(ROWS_SQL, params).as_dicts(),
            "anomalies": store.read_query(ANOMALIES_SQL, params).as_dicts(),
            "calls": store.read_query(CALLS_SQL, calls_params(params)).as_dicts(),
            "pids": store.read_query(PIDS_SQL, params).as_dicts() if with_pids else []}


def write_trace(args, params: dict, seconds: float, stored: dict) -> int:
    """The Chrome trace of what read_stored found (and of --records) written to --out; 1 if it is empty."""
    from fleetscope.chrome_trace import ChromeTrace
    job, rank = params["job"], (params["rank"] if params["rank"] >= 0 else None)
    trace = ChromeTrace()
    n_rows = trace.add_rows(stored["rows"])
    n_calls = add_stored_calls(trace, stored["calls"])
    if args.records:
        rank_of_pid = {int(p["pid"]): int(p["rank"]) for p in stored["pids"]
                       if rank is None or int(p["rank"]) == rank}
        n_calls += trace.add_calls(read_records(args.records), rank_of_pid)
    n_anom = trace.add_anomalies(stored["anomalies"])
    if not (n_rows or n_calls or n_anom):
        print(f"fleetscope trace: nothing stored for job {job!r} in its last {seconds:g} s "
              f"(traced sources: {', '.join(TRACED)}); check the job name with "
              "`fleetscope query \"SELECT DISTINCT tenant, job FROM raw_metrics\"`", file=sys.stderr)
        return 1
    Path(args.out).write_text(json.dumps(trace.to_json(job=job, seconds=seconds)))
    print(f"wrote {args.out}: {n_rows} interval events, {n_calls} calls, {n_anom} anomaly windows "
          f"(open it in ui.perfetto.dev or chrome://tracing)")
    return 0


def live_trace(args, cfg) -> int:
    """--live: request the job's next N seconds of calls from the agents, wait for the store to hold them, export."""
    if args.anomaly:
        print("fleetscope trace: --live takes --job, not --anomaly", file=sys.stderr)
        return 2
    bootstrap = kafka_or_explain(cfg, "trace --live")
    if not bootstrap:
        return 2
    params = job_params(args)
    try:
        req = build_request(params["job"], args.seconds, cfg.trace_request_max_s, params["tenant"], params["rank"])
    except CaptureRequestError as exc:
        print(f"fleetscope trace: --live: {exc}", file=sys.stderr)
        return 2
    store = open_configured_store(cfg)  # before asking: a store that cannot be read fails now, not after N s
    try:
        try:
            publish_request(cfg, bootstrap, req)
        except RuntimeError as exc:
            print(f"fleetscope trace: {exc}", file=sys.stderr)
            return 1
        params["since_ns"], params["until_ns"] = req.from_ns, req.to_ns + 1
        params["request_id"] = req.request_id  # its own calls: not an anomaly's capture, nor another request's
        which = "all ranks" if req.rank < 0 else f"rank {req.rank}"
        print(f"requested {args.seconds:g} s of calls of job {req.job} ({which}) from the agents (request "
              f"{req.request_id}); waiting for the span to end and the agents to publish it ...", flush=True)
        found = wait_for_calls(store, params, req.to_ns + int(2 * cfg.sample_interval_s * 1e9))
        if not found:
            print(f"fleetscope trace: no calls of job {req.job!r} ({which}) reached the store within "
                  f"{LIVE_GRACE_S:g} s of the span's end. Likely: no agent with trace_capture_s > 0 hosts the "
                  "job (only capturing agents answer requests: their CUDA, NCCL and torch tracers keep per-call "
                  "records, for the span, or always with trace_capture_anomalies), "
                  "the job made no CUDA, NCCL or traced torch calls in the span, or the sink is not running "
                  "(`fleetscope up` or `fleetscope sink`)", file=sys.stderr)
            return 1
        print(f"the store holds {found} calls of the span", flush=True)
        stored = read_stored(store, params, args.records)
    finally:
        store.close()
    return write_trace(args, params, args.seconds, stored)


def wait_for_calls(store, params: dict, settled_ns: int, clock_ns=time.time_ns, sleep=time.sleep) -> int:
    """How many calls trace_events holds for `params` once the agents have published them: 0 if none came by
    LIVE_GRACE_S after `settled_ns` (the span's end plus the agents' settle time). It waits until then, and
    afterwards until the count stops growing (pieces and their parts arrive one after another)."""
    deadline = settled_ns + int(LIVE_GRACE_S * 1e9)
    while clock_ns() < settled_ns:
        sleep(min(LIVE_POLL_S, (settled_ns - clock_ns()) / 1e9))
    last = -1
    while True:
        n = int(store.read_query(CALLS_COUNT_SQL, calls_params(params)).as_dicts()[0]["n"])
        if n and n == last:
            return n
        if clock_ns() >= deadline:
            return n
        last = n
        sleep(LIVE_POLL_S)


def register(sub) -> None:
    p = sub.add_parser("trace", help="export a job's last N seconds as a Perfetto / chrome://tracing timeline")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--job", help="the job to export")
    which.add_argument("--anomaly", metavar="ID", help="export one anomaly's rank, its window ± one window: "
                       "TENANT/JOB/RANK/WINDOW_START_NS, as alerts carry it (annotation anomaly_id)")
    p.add_argument("--tenant", help="the job's tenant (default: any)")
    p.add_argument("--rank", type=int, help="only this rank (default: all)")
    p.add_argument("--seconds", type=float, default=60.0, help="how far back from the job's newest row (default: "
                   "60); with --live, how many seconds from now to capture (at most trace_request_max_s)")
    p.add_argument("--out", required=True, help="the JSON file to write (Chrome trace event format)")
    p.add_argument("--records", metavar="FILE", help="also per-call records captured in detail mode (JSON lines)")
    p.add_argument("--live", action="store_true", help="ask the agents (those with trace_capture_s > 0) for the "
                   "job's calls over the next --seconds, wait until the store holds them (at most --seconds + 30 s), "
                   "and export that span; needs Kafka (FLEETSCOPE_KAFKA)")
    p.set_defaults(func=cmd_trace)
