"""The Chrome trace event format (JSON) that ui.perfetto.dev and chrome://tracing open, built from what
fleetscope has: per-call records of the tracers' detail mode, the store's aggregated traced rows, and anomaly
windows.

- one process per rank (pid = rank, named "rank R (host)"), one thread track per traced thread;
- each call a complete event ("ph": "X") with its duration; collectives carry their bytes (and count, datatype,
  op) as args;
- aggregated rows (the store keeps sums per interval, not calls) a complete event per row on a track of its
  source, spanning the interval the row covers, with the value as an arg;
- each flagged window an instant event ("ph": "i") at its start, with score, threshold and detectors.

Timestamps are microseconds (the format's unit) since the Unix epoch, as floats, so ns precision survives.
"""
from __future__ import annotations

from typing import Iterable

ARG_KEYS = ("bytes", "count", "datatype", "op", "root", "peer", "kind", "stream", "rc", "kernel", "grid", "block")
AGG_TID_BASE = 1_000_000_000  # synthetic thread ids of the aggregated tracks, above any real tid


def _us(ns: int | float) -> float:
    # int / int is rounded once, to the nearest float; ns / 1000.0 would first round ns (~1.8e18, past 2**53)
    # to a float, moving a call by up to 128 ns
    return ns / 1000


class ChromeTrace:
    def __init__(self):
        self.events: list[dict] = []
        self._processes: dict[int, str] = {}
        self._threads: dict[tuple[int, int], str] = {}

    def process(self, rank: int, host: str = "") -> int:
        if rank not in self._processes:
            self._processes[rank] = f"rank {rank} ({host})" if host else f"rank {rank}"
        return rank

    def thread(self, pid: int, tid: int, name: str) -> int:
        self._threads.setdefault((pid, tid), name)
        return tid

    def add_calls(self, records: Iterable[dict], rank_of_pid: dict[int, int], host: str = "",
                  source: str = "") -> int:
        """Per-call records ({api, pid, tid, ts_ns, dur_ns, ...}); calls of pids without a rank are skipped."""
        n = 0
        for r in records:
            rank = rank_of_pid.get(int(r["pid"]))
            if rank is None:
                continue
            pid = self.process(rank, host)
            tid = self.thread(pid, int(r["tid"]), f"thread {r['tid']}")
            args = {k: _jsonable(r[k]) for k in ARG_KEYS if k in r}
            self.events.append({"name": str(r.get("kernel") or r["api"]), "cat": source or "call", "ph": "X",
                                "ts": _us(r["ts_ns"]), "dur": _us(r["dur_ns"]), "pid": pid, "tid": tid,
                                "args": {"api": r["api"], **args}})
            n += 1
        return n

    def add_rows(self, rows: Iterable[dict]) -> int:
        """Aggregated store rows ({rank, host, source, metric, device, ts_ns, interval_ns, value, sample_frac})."""
        n = 0
        tracks: dict[str, int] = {}
        for r in rows:
            if int(r["interval_ns"]) <= 0:
                continue  # a gauge has no span
            pid = self.process(int(r["rank"]), str(r.get("host", "")))
            tid = tracks.setdefault(r["source"], AGG_TID_BASE + len(tracks))
            self.thread(pid, tid, f"{r['source']} (aggregated per interval)")
            end = int(r["ts_ns"])
            self.events.append({"name": f"{r['metric']} {r['device']}".strip(), "cat": r["source"], "ph": "X",
                                "ts": _us(end - int(r["interval_ns"])), "dur": _us(r["interval_ns"]),
                                "pid": pid, "tid": tid,
                                "args": {"value": float(r["value"]), "sample_frac": float(r.get("sample_frac", 1.0))}})
            n += 1
        return n

    def add_anomalies(self, anomalies: Iterable[dict]) -> int:
        """Flagged windows ({rank, host, window_start_ns, score, threshold, detectors})."""
        n = 0
        for a in anomalies:
            pid = self.process(int(a["rank"]), str(a.get("host", "")))
            self.thread(pid, 0, "anomalies")
            self.events.append({"name": "anomaly", "cat": "anomaly", "ph": "i", "s": "p",
                                "ts": _us(a["window_start_ns"]), "pid": pid, "tid": 0,
                                "args": {"score": float(a["score"]), "threshold": float(a["threshold"]),
                                         "detectors": list(a.get("detectors", []))}})
            n += 1
        return n

    def to_json(self, **other) -> dict:
        meta = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}
                for pid, name in sorted(self._processes.items())]
        meta += [{"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
                 for pid in sorted(self._processes)]
        meta += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
                 for (pid, tid), name in sorted(self._threads.items())]
        return {"traceEvents": meta + sorted(self.events, key=lambda e: e["ts"]), "displayTimeUnit": "ms",
                "otherData": {k: str(v) for k, v in other.items()}}


def _jsonable(v):
    return list(v) if isinstance(v, tuple) else v
