"""`fleetscope trace` and the Chrome trace builder: the JSON that Perfetto opens, from rows stored in real chDB
(through the store's own insert path) and from per-call records of the real CUDA tracer in detail mode on a
stand-in workload (tests/gpu_stub: no GPU here) whose call durations the test sets."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from fleetscope.chrome_trace import ChromeTrace
from fleetscope.store import open_store
from support import gpu_fixtures as fixtures

make, stubs = fixtures.make, fixtures.stubs

INTERVAL_NS = 1_000_000_000
PIDS = {0: 4100, 1: 4101}


def insert_traced_rows(store, end_ns: int) -> None:
    rows = []
    for rank, pid in PIDS.items():
        for i in range(5):
            ts = end_ns - (4 - i) * INTERVAL_NS
            rows.append(("cuda", rank, pid, ts, "cuda.launch_ns", "all", 1e8 * (rank + 1)))
            rows.append(("nccl", rank, pid, ts, "nccl.bytes", "AllReduce", 4096.0))
    n = len(rows)
    store.insert("raw_metrics", {
        "source": [r[0] for r in rows], "tenant": ["acme"] * n, "job": ["train-1"] * n,
        "host": [f"h{r[1]}" for r in rows], "rank": np.array([r[1] for r in rows], dtype=np.int32),
        "pid": np.array([r[2] for r in rows], dtype=np.int32), "gpu": np.zeros(n, dtype=np.int16),
        "ts": np.array([r[3] for r in rows], dtype=np.int64), "metric": [r[4] for r in rows],
        "device": [r[5] for r in rows], "value": np.array([r[6] for r in rows]),
        "interval_ns": np.full(n, INTERVAL_NS, dtype=np.int64), "sample_frac": np.ones(n),
        "batch_id": ["b1"] * n})
    store.insert("anomalies", {
        "tenant": ["acme"], "job": ["train-1"], "host": ["h1"], "rank": np.array([1], dtype=np.int32),
        "window_start": np.array([end_ns - 2 * INTERVAL_NS], dtype=np.int64), "score": np.array([31.0]),
        "threshold": np.array([20.0]), "detectors": [["gmm"]], "contributions": [{}], "peer_z": [{}],
        "feature": [{}], "emitted_at": np.array([end_ns], dtype=np.int64)})


def test_fleetscope_trace_exports_stored_rows_calls_and_anomalies(tmp_path):
    end_ns = (time.time_ns() // 10**9) * 10**9
    store = open_store(tmp_path, clickhouse_url=None, prefer_endpoint=False)
    store.migrate()
    insert_traced_rows(store, end_ns)
    store.close()  # the CLI opens the data directory in its own process
    records = tmp_path / "calls.jsonl"
    calls = [{"api": "ncclAllReduce", "pid": PIDS[1], "tid": 77, "ts_ns": end_ns - 500_000_000, "dur_ns": 2_500_000,
              "rc": 0, "bytes": 1 << 20, "count": 262144, "datatype": "float32", "op": "sum"},
             {"api": "cudaStreamSynchronize", "pid": PIDS[0], "tid": 70, "ts_ns": end_ns - 400_000_000,
              "dur_ns": 2_000_000, "rc": 0},
             {"api": "cudaMalloc", "pid": 999, "tid": 1, "ts_ns": end_ns, "dur_ns": 5, "rc": 0}]  # not the job's
    records.write_text("\n".join(json.dumps(c) for c in calls) + "\n")
    out = tmp_path / "trace.json"
    env = {**os.environ, "FLEETSCOPE_DATA_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "fleetscope", "trace", "--job", "train-1", "--seconds", "60",
                          "--out", str(out), "--records", str(records)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert "20 interval events, 2 calls, 1 anomaly windows" in run.stdout
    events = json.loads(out.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0 (h0)", 1: "rank 1 (h1)"}  # one process per rank
    spans = [e for e in events if e["ph"] == "X" and e["cat"] in ("cuda", "nccl")]
    assert len(spans) == 20 and {e["dur"] for e in spans} == {INTERVAL_NS / 1000}
    assert max(e["ts"] + e["dur"] for e in spans) == end_ns / 1000  # a row's span ends at its timestamp
    by_api = {e["args"]["api"]: e for e in events if e["ph"] == "X" and e["cat"] == "call"}
    assert set(by_api) == {"ncclAllReduce", "cudaStreamSynchronize"}
    allreduce = by_api["ncclAllReduce"]
    assert (allreduce["pid"], allreduce["tid"], allreduce["dur"]) == (1, 77, 2500.0)
    assert allreduce["args"]["bytes"] == 1 << 20 and allreduce["args"]["op"] == "sum"
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert threads[(1, 77)] == "thread 77" and threads[(0, 70)] == "thread 70"
    instants = [e for e in events if e["ph"] == "i"]
    assert [(e["pid"], e["ts"], e["args"]["score"]) for e in instants] == [(1, (end_ns - 2 * INTERVAL_NS) / 1000, 31.0)]

    missing = subprocess.run([sys.executable, "-m", "fleetscope", "trace", "--job", "nope", "--out",
                              str(tmp_path / "x.json")], env=env, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "nothing stored for job 'nope'" in missing.stderr


@pytest.fixture
def tracer_cls():
    from fleetscope.producers.tracers.cuda import CudaTracer
    return CudaTracer


@pytest.mark.skipif(os.geteuid() != 0, reason="loading BPF programs needs root (CI runs as root)")
def test_detail_records_of_a_traced_stand_in_become_calls_with_the_workloads_durations(make):
    """The stand-in sleeps 2000 us in every cudaStreamSynchronize and 300 us in cudaDeviceSynchronize; each
    exported call lasts at least that (the uprobe pair measures the whole call) and not wildly more."""
    make_tracer, make_workload = make
    tracer = make_tracer(detail=True)
    iters = 10
    w = make_workload("cuda", iters, 0, late_load=True, env={
        "GPU_STUB_DELAY_US": "cudaStreamSynchronize=2000,cudaDeviceSynchronize=300"})
    w.load()
    w.loaded()
    assert tracer.add_pid(w.pid) is True
    w.go()
    assert w.finish()[0] == iters
    tracer.sample()
    trace = ChromeTrace()
    assert trace.add_calls(tracer.records, {w.pid: 3}, host="node-a", source="cuda") == len(tracer.records)
    events = json.loads(json.dumps(trace.to_json()))["traceEvents"]
    for api, floor_us in (("cudaStreamSynchronize", 2000.0), ("cudaDeviceSynchronize", 300.0)):
        durs = [e["dur"] for e in events if e["ph"] == "X" and e["args"]["api"] == api]
        assert len(durs) == iters, api
        # every call lasts at least the stand-in's sleep; a loaded machine can wake a sleeper tens of ms late,
        # so the bound above is on the median, which one late wake-up cannot move
        assert all(floor_us <= d for d in durs), (api, durs)
        assert sorted(durs)[len(durs) // 2] < floor_us + 50_000, (api, durs)
    assert {e["pid"] for e in events if e["ph"] == "X"} == {3}
    tids = {e["tid"] for e in events if e["ph"] == "X"}
    assert tids and {(3, t) for t in tids} <= {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"}
