"""<prefix>.traces messages (fs-schema trace/1, fleetscope/trace_message.py) as trace_events rows: one per call.
A piece of a live capture request stores its request_id; a capture around an anomaly, which has none, ''."""
from __future__ import annotations

import json

import numpy as np

HEAD = ("tenant", "job", "host", "rank")


def trace_events_rows(messages: list[tuple[dict, int]]) -> dict:
    """(decoded message, emitted_at ns) pairs -> the trace_events columns."""
    cols: dict[str, list] = {k: [] for k in (*HEAD, "window_start", "request_id", "source", "api", "pid", "tid",
                                              "ts", "dur_ns", "args", "emitted_at")}
    for m, emitted_at in messages:
        request_id = m.get("request_id", "")
        for c in m["calls"]:
            for k in HEAD:
                cols[k].append(m[k])
            cols["window_start"].append(m["window_start_ns"])
            cols["request_id"].append(request_id)
            for k in ("source", "api", "pid", "tid", "dur_ns"):
                cols[k].append(c[k])
            cols["ts"].append(c["ts_ns"])
            cols["args"].append(json.dumps(c.get("args", {}), separators=(",", ":")))
            cols["emitted_at"].append(emitted_at)
    for name, dtype in (("rank", np.int32), ("pid", np.int32), ("tid", np.int32), ("window_start", np.int64),
                        ("ts", np.int64), ("dur_ns", np.int64), ("emitted_at", np.int64)):
        cols[name] = np.array(cols[name], dtype=dtype)
    return cols
