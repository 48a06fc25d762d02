"""The `<prefix>.traces` message: one rank's per-call records around one anomaly, as the agent captured them.

JSON, like the other event-like derived topics (anomalies, diagnoses), not Arrow like features and scores: a
capture is rare (one per anomaly of a rank), its records differ per API (a launch has grid and block, a
collective bytes, count, datatype and op), and its readers are the sink and timeline tools, not a columnar
pipeline. Each message carries `fs-schema: trace/1` (schemas/trace.schema.json) and the key tenant/job.
A piece that answers a live capture request (fleetscope/capture_request.py) carries its `request_id`; a capture
around an anomaly has none.

A capture larger than a Kafka message is split into parts (`part` of `parts`), each under the producer's
message limit; a single call never is.
"""
from __future__ import annotations

import json

TRACE_SCHEMA = "trace/1"
CALL_FIELDS = ("source", "api", "pid", "tid", "ts_ns", "dur_ns")  # every call has these; the rest go to args
HEAD_ROOM = 512  # bytes kept free for the message's own fields beyond the calls


def call_of(record: dict, source: str) -> dict:
    """A tracer's detail record ({api, pid, tid, ts_ns, dur_ns, ...}) as a message call."""
    args = {k: list(v) if isinstance(v, tuple) else v for k, v in record.items() if k not in CALL_FIELDS}
    return {"source": source, "api": str(record["api"]), "pid": int(record["pid"]), "tid": int(record["tid"]),
            "ts_ns": int(record["ts_ns"]), "dur_ns": int(record["dur_ns"]), "args": args}


def trace_messages(head: dict, calls: list[dict], max_bytes: int) -> list[tuple[bytes, bytes]]:
    """(key, value) of each part: `head` (tenant, job, host, rank, window_start_ns, window_end_ns, from_ns,
    to_ns, and request_id when a request asked for it) with part, parts and as many calls as fit under
    max_bytes. Every part repeats the whole head, and the budget for its calls is what the head leaves."""
    budget = max(max_bytes - len(json.dumps(head)) - HEAD_ROOM, 1)
    groups: list[list[str]] = [[]]
    used = 0
    for call in calls:
        text = json.dumps(call, separators=(",", ":"))
        if groups[-1] and used + len(text) + 1 > budget:
            groups.append([])
            used = 0
        groups[-1].append(text)
        used += len(text) + 1
    key = f"{head['tenant']}/{head['job']}".encode()
    out = []
    for i, group in enumerate(groups):
        meta = json.dumps({**head, "part": i, "parts": len(groups)}, separators=(",", ":"))
        out.append((key, (meta[:-1] + ',"calls":[' + ",".join(group) + "]}").encode()))
    return out
