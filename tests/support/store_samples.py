"""A small fleet's worth of rows, inserted through the store's own insert path (Store.insert), with the facts
the saved queries and dashboard panels should find in them.

Two tenants: acme/train-1 (ranks 0-3 on hosts h0 and h1, rank 2 a straggler flagged as the culprit in six
windows, rank 0 flagged in the same windows as waiting on it, as the sink stores a waiting peer) and beta/eval-2 (ranks 0-1 on h1, never flagged). Node windows (tenant `_node`, job = host) carry host and GPU
features. Windows are one minute apart and end a minute before `now`, so "the last hour" holds all of them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

WINDOWS = 10
STEP_NS = 60 * 10**9
STRAGGLER = 2
FLAGGED = (3, 4, 5, 6, 7, 8)  # window indices where rank 2 is flagged
WAITING = 0                   # the rank (on h0) flagged in the same windows as waiting on the straggler
CPU_ENTRY = (3, 4, 5, 6)      # of those, the windows diagnosed as cpu_contention; the rest are unmatched
RANKS = {("acme", "train-1"): {0: "h0", 1: "h0", 2: "h1", 3: "h1"}, ("beta", "eval-2"): {0: "h1", 1: "h1"}}
ENERGY_J = {("acme", "train-1"): 50.0, ("beta", "eval-2"): 20.0}  # per rank and window
OFU = {"h0": 40.0, "h1": 55.0}
DLQ = (("bad magic: not an Arrow IPC stream", "fs.raw.host", 3), ("future schema version 9", "fs.raw.nvml", 1))


@dataclass
class SampleFleet:
    window_starts_ns: list[int]
    facts: dict = field(default_factory=dict)

    @property
    def first_ns(self) -> int:
        return self.window_starts_ns[0]

    @property
    def last_ns(self) -> int:
        return self.window_starts_ns[-1]


def insert_sample_fleet(store, now_ns: int | None = None) -> SampleFleet:
    now_ns = now_ns or time.time_ns()
    base = (now_ns // STEP_NS) * STEP_NS - (WINDOWS + 1) * STEP_NS
    starts = [base + i * STEP_NS for i in range(WINDOWS)]
    fleet = SampleFleet(starts)
    _features(store, starts)
    _scores_and_anomalies(store, starts, now_ns)
    _diagnoses(store, starts, now_ns)
    _dlq(store, now_ns)
    fleet.facts = {
        "energy_j": {job: e * len(RANKS[job]) * WINDOWS for job, e in ENERGY_J.items()},
        "ofu": OFU,
        "straggler": STRAGGLER,
        "flagged": len(FLAGGED),  # the culprit's windows: what counts as an anomaly
        "waiting": WAITING,
        "kb": {"cpu_contention": len(CPU_ENTRY), "unmatched": len(FLAGGED) - len(CPU_ENTRY)},
        "dlq": {(reason, topic): n for reason, topic, n in DLQ},
    }
    return fleet


def _rank_rows():
    for (tenant, job), ranks in RANKS.items():
        for rank, host in ranks.items():
            yield tenant, job, rank, host


def _features(store, starts) -> None:
    cols = {k: [] for k in ("tenant", "job", "host", "rank", "window_start", "window_end", "feature_version",
                            "feature", "sources", "event_count", "emitted_at")}

    def add(tenant, job, host, rank, start, feature, sources):
        for k, v in (("tenant", tenant), ("job", job), ("host", host), ("rank", rank), ("window_start", start),
                     ("window_end", start + 10**9), ("feature_version", 4), ("feature", feature),
                     ("sources", sources), ("event_count", 100), ("emitted_at", start + 2 * 10**9)):
            cols[k].append(v)

    for i, start in enumerate(starts):
        for tenant, job, rank, host in _rank_rows():
            slow = (tenant, job, rank) == ("acme", "train-1", STRAGGLER) and i in FLAGGED
            add(tenant, job, host, rank, start,
                {"gpu_energy_j": ENERGY_J[(tenant, job)], "nccl_time_frac": 0.05 if slow else 0.4,
                 "nccl_calls_per_s": 5.0 if slow else 10.0, "gpu_proc_sm_util": 80.0}, ["nvml", "nccl"])
        for host, ofu in OFU.items():
            add("_node", host, host, -1, start,
                {"gpu_ofu": ofu, "gpu_util": 90.0, "gpu_power_w": 300.0, "gpu_energy_j": 300.0,
                 "gpu_throttled": 0.0, "cpu_busy_frac": 0.5, "mem_used_frac": 0.3}, ["host", "nvml"])
    store.insert("features", {k: (np.array(v, dtype=np.int64) if k in ("window_start", "window_end", "emitted_at")
                                  else np.array(v, dtype=np.int32) if k in ("rank", "event_count")
                                  else np.array(v, dtype=np.uint16) if k == "feature_version" else v)
                              for k, v in cols.items()})


def _scores_and_anomalies(store, starts, now_ns) -> None:
    s = {k: [] for k in ("tenant", "job", "host", "rank", "window_start", "score", "threshold", "is_anomaly",
                         "role", "detectors", "warm", "emitted_at")}
    a = {k: [] for k in ("tenant", "job", "host", "rank", "window_start", "score", "threshold", "detectors", "role",
                         "contributions", "peer_z", "feature", "emitted_at")}
    for i, start in enumerate(starts):
        for tenant, job, rank, host in _rank_rows():
            in_fault = (tenant, job) == ("acme", "train-1") and i in FLAGGED
            role = ("culprit" if rank == STRAGGLER else "waiting" if rank == WAITING else "") if in_fault else ""
            score = 30.0 + i if role == "culprit" else 21.0 if role == "waiting" else 5.0 + rank * 0.1
            for k, v in (("tenant", tenant), ("job", job), ("host", host), ("rank", rank), ("window_start", start),
                         ("score", score), ("threshold", 20.0), ("is_anomaly", int(bool(role))), ("role", role),
                         ("detectors", ["gmm", "peer"] if role else []), ("warm", 1), ("emitted_at", now_ns)):
                s[k].append(v)
            if role:
                own = role == "culprit"  # a waiting row comes from its score: no contributions (streams/sink/tables.py)
                for k, v in (("tenant", tenant), ("job", job), ("host", host), ("rank", rank),
                             ("window_start", start), ("score", score), ("threshold", 20.0),
                             ("detectors", ["gmm", "peer"]), ("role", role),
                             ("contributions", {"nccl_time_frac": 6.0, "cpu_busy_frac": 3.0, "gpu_util": 1.0} if own
                              else {}),
                             ("peer_z", {"nccl_time_frac": -4.0} if own else {}),
                             ("feature", {"nccl_time_frac": 0.05} if own else {}), ("emitted_at", now_ns)):
                    a[k].append(v)
    store.insert("scores", _typed(s))
    store.insert("anomalies", _typed(a))


def _diagnoses(store, starts, now_ns) -> None:
    d = {k: [] for k in ("tenant", "job", "host", "rank", "window_start", "kb_entry", "confidence", "similarity",
                         "fingerprint", "fingerprint_unsigned", "evidence", "rules_held", "detectors", "score",
                         "threshold", "emitted_at")}
    for i in FLAGGED:
        entry = "cpu_contention" if i in CPU_ENTRY else "unmatched"
        for k, v in (("tenant", "acme"), ("job", "train-1"), ("host", "h1"), ("rank", STRAGGLER),
                     ("window_start", starts[i]), ("kb_entry", entry),
                     ("confidence", 0.8 if entry != "unmatched" else 0.0), ("similarity", 0.9),
                     ("fingerprint", {"cpu": 0.7, "comm": -0.3}), ("fingerprint_unsigned", []),
                     ("evidence", {"cpu_busy_frac": 0.97, "peer_z.nccl_time_frac": -4.0}),
                     ("rules_held", ["cpu_busy_frac > 0.9"] if entry != "unmatched" else []),
                     ("detectors", ["gmm", "peer"]), ("score", 30.0 + i), ("threshold", 20.0),
                     ("emitted_at", now_ns)):
            d[k].append(v)
    store.insert("diagnoses", _typed(d))


def _dlq(store, now_ns) -> None:
    rows = [(reason, topic) for reason, topic, n in DLQ for _ in range(n)]
    store.insert("dlq", {"ts": np.full(len(rows), now_ns - 30 * 10**9, dtype=np.int64),
                         "topic": [t for _, t in rows], "partition": np.zeros(len(rows), dtype=np.int32),
                         "offset": np.arange(len(rows), dtype=np.int64), "reason": [r for r, _ in rows],
                         "source": ["host"] * len(rows), "host": ["h0"] * len(rows), "batch_id": [""] * len(rows),
                         "size": np.full(len(rows), 128, dtype=np.uint32), "payload_head": ["xx"] * len(rows)})


INT64 = {"window_start", "emitted_at"}
INT32 = {"rank"}
FLOAT = {"score", "threshold", "confidence", "similarity"}


def _typed(cols: dict) -> dict:
    out = {}
    for k, v in cols.items():
        if k in INT64:
            out[k] = np.array(v, dtype=np.int64)
        elif k in INT32:
            out[k] = np.array(v, dtype=np.int32)
        elif k in FLOAT:
            out[k] = np.array(v, dtype=np.float64)
        elif k in ("is_anomaly", "warm"):
            out[k] = np.array(v, dtype=np.uint8)
        else:
            out[k] = v
    return out
