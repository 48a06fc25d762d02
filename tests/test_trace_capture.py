"""Capture around anomalies (producers/trace_capture.py) end to end: the real CUDA tracer in detail mode on two
stand-in ranks (src/fleetscope/eval/gpu_stub: this machine has no GPU; everything else is real: uprobes, the BPF
ring buffer, /proc identities), sampled through the real TracerManager into the capture's ring; an anomaly of
one rank on the embedded broker; `<prefix>.traces` read back; the real sink storing it in chDB's trace_events;
and `fleetscope trace` putting those calls on the timeline with the tracer's own durations.
The ring's bounds are checked on their own, with a clock the test moves; the message's parts, the sink's
request_id (a live request's piece against an anomaly's capture) and its migration on their own too."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from importlib.resources import files

import jsonschema
import pytest
from confluent_kafka import Consumer, Producer

from fleetscope.producers.trace_capture import CallRing, TraceCapture
from fleetscope.store import open_store
from fleetscope.store.migrations import apply, discover
from fleetscope.streams.sink.trace_rows import trace_events_rows
from fleetscope.trace_message import TRACE_SCHEMA, trace_messages
from support import gpu_fixtures as fixtures
from support.capture_topics import capture_piece, capturing_agent
from support.subscribed_sink import subscribed_sink

make, stubs = fixtures.make, fixtures.stubs
NOW = 1_800_000_000_000_000_000  # in the future, so the store's TTL keeps it


def trace_schema() -> dict:
    return json.loads(files("fleetscope.schemas").joinpath("trace.schema.json").read_text())


def test_the_ring_is_bounded_by_age_and_by_count_and_counts_what_it_drops():
    now = [10_000_000_000]
    ring = CallRing(keep_s=2.0, max_records=5, clock_ns=lambda: now[0])
    key, other = ("t", "j", 1), ("t", "j", 2)
    calls = [{"ts_ns": now[0] - 100 + i, "i": i} for i in range(8)]
    ring.add(key, calls)
    assert len(ring) == 5 and ring.dropped == 3 and ring.expired == 0  # the 3 oldest went for the count
    assert [c["i"] for c in ring.window(key, 0, now[0])] == [3, 4, 5, 6, 7]
    assert ring.window(other, 0, now[0]) == []
    now[0] += 1_500_000_000
    ring.add(other, [{"ts_ns": now[0], "i": 100}])  # one more: the oldest of key goes for the count
    assert len(ring) == 5 and ring.dropped == 4
    now[0] += 1_000_000_000  # key's calls are now 2.5 s old, other's 1 s
    assert ring.window(key, 0, now[0]) == [] and [c["i"] for c in ring.window(other, 0, now[0])] == [100]
    assert len(ring) == 1 and ring.expired == 4 and ring.dropped == 4 and ring.added == 9


@pytest.fixture
def tracer_cls():
    from fleetscope.producers.tracers.cuda import CudaTracer
    return CudaTracer


def read_traces(cfg, bootstrap: str, want_calls: int, timeout_s: float = 60.0) -> list[tuple[dict, dict]]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"read-{uuid.uuid4().hex[:6]}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([cfg.topic("traces")])
    got, deadline = [], time.monotonic() + timeout_s
    try:
        while sum(len(m["calls"]) for m, _ in got) < want_calls and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                got.append((json.loads(msg.value()), dict(msg.headers() or ())))
        extra = consumer.poll(1.0)  # nothing more: not another rank's, not twice
        assert extra is None or extra.error() is not None, extra.value()[:200]
    finally:
        consumer.close()
    return got


def publish_anomaly(producer, cfg, host: str, tenant: str, job: str, rank: int, window_start_ns: int) -> None:
    a = {"tenant": tenant, "job": job, "host": host, "rank": rank, "window_start_ns": window_start_ns,
         "role": "culprit", "culprit_ranks": [rank], "score": 42.0, "threshold": 20.0, "detectors": ["gmm"],
         "contributions": {}, "peer_z": {}, "features": {}}
    producer.produce(cfg.topic("anomalies"), value=json.dumps(a).encode(), key=f"{tenant}/{job}".encode(),
                     headers=[("fs-schema", b"anomaly/1")])
    assert producer.flush(10) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="loading BPF programs needs root (CI runs as root)")
def test_an_anomaly_publishes_its_ranks_window_which_the_sink_stores_and_trace_exports(make, pipeline_cfg, broker,
                                                                                      tmp_path):
    cfg = replace(pipeline_cfg, kafka=broker.bootstrap, trace_capture_s=30.0, window_s=0.2, sample_interval_s=0.1)
    job = f"job-{uuid.uuid4().hex[:6]}"
    make_tracer, make_workload = make
    tracer, manager, capture = capturing_agent(make_tracer, cfg, broker.bootstrap)
    try:
        ranks = {}
        for rank in (0, 1):  # two ranks of one job on this host; each sleeps 4 ms in every cudaStreamSynchronize
            w = make_workload("cuda", 300, 0, late_load=True, env={
                "GPU_STUB_DELAY_US": "cudaStreamSynchronize=4000", "FLEETSCOPE_JOB": job, "RANK": str(rank)})
            w.load()
            w.loaded()
            assert tracer.add_pid(w.pid) is True
            ranks[rank] = w
        for w in ranks.values():
            w.go()
        seen: list[dict] = []  # every record the tracer gave, as the ticks drained them
        while any(w.proc.poll() is None for w in ranks.values()):  # the agent's ticks while the ranks run
            manager.sample(time.time_ns())
            seen += tracer.records
            time.sleep(cfg.sample_interval_s)
        for w in ranks.values():
            assert w.finish()[0] == 300
        manager.sample(time.time_ns())  # the calls after the last tick, of processes now gone
        seen += tracer.records
        assert capture.errors == 0 and capture.unranked == 0
        assert capture.ring.added == len(seen) and capture.ring.dropped == 0

        mine = sorted((r for r in seen if r["pid"] == ranks[1].pid), key=lambda r: r["ts_ns"])
        first, last = mine[0]["ts_ns"], mine[-1]["ts_ns"]
        assert last - first > 800_000_000, "the run is too short to have calls on both sides of the window"
        start = ((first + last) // 2 - 100_000_000) // 10**6 * 10**6  # windows start on whole ms (anomalies table)
        lo, hi = start - 200_000_000, start + 400_000_000  # the window (0.2 s) ± one window
        want = {(r["pid"], r["tid"], r["api"], r["ts_ns"], r["dur_ns"]) for r in mine if lo <= r["ts_ns"] <= hi}
        assert 0 < len(want) < len(mine)
        tenant = cfg.default_tenant

        producer = Producer({"bootstrap.servers": broker.bootstrap})
        publish_anomaly(producer, cfg, "another-host", tenant, job, 0, start)  # not this agent's rank
        publish_anomaly(producer, cfg, cfg.host, tenant, job, 1, start)
        publish_anomaly(producer, cfg, cfg.host, tenant, job, 1, start)  # a replay: captured once

        got = read_traces(cfg, broker.bootstrap, len(want))
        schema = trace_schema()
        for m, headers in got:
            jsonschema.validate(m, schema)
            assert "request_id" not in m  # no request asked for it
            assert headers["fs-schema"] == TRACE_SCHEMA.encode()
            assert (m["tenant"], m["job"], m["host"], m["rank"], m["window_start_ns"]) == \
                (tenant, job, cfg.host, 1, start)
            assert (m["from_ns"], m["to_ns"]) == (lo, hi)
        calls = [c for m, _ in got for c in m["calls"]]
        assert len(calls) == len(want)
        assert {(c["pid"], c["tid"], c["api"], c["ts_ns"], c["dur_ns"]) for c in calls} == want
        assert all(c["source"] == "cuda" for c in calls)
        assert capture.anomalies == 1 and capture.calls_published == len(want)
    finally:
        capture.close()
        manager.close()
    assert capture.published == len(got) and capture.publish_errors == 0

    store = open_store(cfg.data_dir, clickhouse_url=None, prefer_endpoint=False)
    try:
        store.migrate()
        sink = subscribed_sink(cfg, store, broker.bootstrap)
        deadline, stored = time.monotonic() + 60, 0
        while stored < len(want) and time.monotonic() < deadline:
            sink.step(0.5)
            stored = int(store.query("SELECT count() AS n FROM trace_events").as_dicts()[0]["n"])
        sink.consumer.close()
        rows = store.query("SELECT tenant, job, host, rank, pid, tid, api, toUnixTimestamp64Nano(ts) AS ts_ns, "
                           "dur_ns, args, request_id FROM trace_events FINAL").as_dicts()
    finally:
        store.close()  # the CLI opens the data directory in its own process
    assert {(r["tenant"], r["job"], r["host"], int(r["rank"])) for r in rows} == {(tenant, job, cfg.host, 1)}
    assert {(int(r["pid"]), int(r["tid"]), r["api"], int(r["ts_ns"]), int(r["dur_ns"])) for r in rows} == want
    assert len(rows) == len(want) and {r["request_id"] for r in rows} == {""}  # a capture around an anomaly

    out = tmp_path / "trace.json"
    run = subprocess.run([sys.executable, "-m", "fleetscope", "trace", "--job", job, "--rank", "1", "--seconds", "60",
                          "--out", str(out)], env={**os.environ, "FLEETSCOPE_DATA_DIR": str(cfg.data_dir)},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"{len(want)} calls, 1 anomaly windows" in run.stdout
    events = json.loads(out.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X" and e["cat"] == "cuda"]
    assert {e["pid"] for e in spans} == {1}  # rank 1's process track
    by_call = {(e["tid"], e["args"]["api"], e["ts"]): e["dur"] for e in spans}
    assert by_call == {(tid, api, ts / 1000): dur / 1000 for _, tid, api, ts, dur in want}  # the tracer's durations
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {1: f"rank 1 ({cfg.host})"}
    assert [e["ts"] for e in events if e["ph"] == "i"] == [start / 1000]

    # the same calls by the anomaly's id (as alerts carry it): its rank, its window ± one window
    by_id = tmp_path / "anomaly.json"
    env = {**os.environ, "FLEETSCOPE_DATA_DIR": str(cfg.data_dir), "FLEETSCOPE_WINDOW_S": str(cfg.window_s)}
    run = subprocess.run([sys.executable, "-m", "fleetscope", "trace", "--anomaly", f"{tenant}/{job}/1/{start}",
                          "--out", str(by_id)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"{len(want)} calls, 1 anomaly windows" in run.stdout
    spans = [e for e in json.loads(by_id.read_text())["traceEvents"] if e["ph"] == "X" and e["cat"] == "cuda"]
    assert {(e["tid"], e["args"]["api"], e["ts"]): e["dur"] for e in spans} == by_call
    for bad, says in ((f"{tenant}/{job}/1/{start + 10**9}", "no anomaly"), (f"{job}/1", "is not TENANT/JOB/RANK")):
        run = subprocess.run([sys.executable, "-m", "fleetscope", "trace", "--anomaly", bad, "--out",
                              str(tmp_path / "bad.json")], env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode != 0 and says in run.stderr, (bad, run.stderr)


def test_a_failing_record_is_counted_never_raised(pipeline_cfg, broker):
    cfg = replace(pipeline_cfg, kafka=broker.bootstrap, trace_capture_s=30.0)
    capture = TraceCapture(cfg, broker.bootstrap, resolver=None)  # not started: only the tick's side
    try:
        capture.add_records("cuda", [{"api": "cudaMalloc", "tid": 1}])  # no pid: a broken record
        capture.add_records("cuda", [{"api": "cudaMalloc", "pid": os.getpid(), "tid": 1, "ts_ns": time.time_ns(),
                                      "dur_ns": 5}])  # no resolver: no rank, not kept
        assert capture.errors == 1 and capture.unranked == 1 and len(capture.ring) == 0
        assert capture.stats()["capture_errors"] == 1
    finally:
        capture.close()


def test_a_span_waits_for_every_tracer_to_be_drained_past_its_end_but_not_past_the_rings_hold(pipeline_cfg,
                                                                                                  broker):
    """A tick that runs late (a loaded host) or a tracer sampled on a later tick must not leave a span's last calls
    out: the span is captured once the tracers were drained past its end plus the settle time; a tracer that
    lags longer does not hold it past three quarters of the ring's keep time after its start (counted)."""
    cfg = replace(pipeline_cfg, kafka=broker.bootstrap, trace_capture_s=4.0, window_s=0.2, sample_interval_s=0.1)
    now = [NOW]
    capture = TraceCapture(cfg, broker.bootstrap, resolver=None, clock_ns=lambda: now[0])  # not started
    ms = 10**6

    def anomaly(start_ns: int) -> None:  # of a rank here: its span is [start - 0.2 s, start + 0.4 s]
        a = {"tenant": "", "job": "train", "host": cfg.host, "rank": 0, "window_start_ns": start_ns}
        capture.on_anomaly(json.dumps(a).encode(), {"fs-schema": b"anomaly/1"})

    def at(t_ms: int, drained_ms: int) -> tuple[int, int]:  # (spans captured, of them early) by then
        now[0] = NOW + t_ms * ms
        capture.drained(NOW + drained_ms * ms)
        capture.capture_due()
        return capture.empty, capture.stats()["capture_published_early"]  # the ring is empty: captured = empty

    try:
        anomaly(NOW)  # settled at +600 ms (its end, +400 ms, and two sample intervals)
        assert at(590, 590) == (0, 0)  # not yet settled
        assert at(900, 590) == (0, 0)  # settled, but a tracer was last sampled before then: its calls may lag
        assert at(901, 600) == (1, 0)  # drained past the settled end: captured
        anomaly(NOW + 1000 * ms)  # span [+800, +1400] ms; the tracers stay drained up to +600 ms from here
        assert at(1700, 600) == (1, 0)
        assert at(3799, 600) == (1, 0)
        assert at(3800, 600) == (2, 1)  # three quarters of the 4 s ring after its start: captured, counted
        assert capture.drained_ns == NOW + 600 * ms and capture.errors == 0
    finally:
        capture.close()


@pytest.mark.parametrize("request_id", ["r1", "x" * 1500])
def test_every_part_carries_the_request_id_and_stays_under_the_limit(request_id):
    schema = trace_schema()
    head, calls = capture_piece("train", 3, [NOW + i * 1000 for i in range(300)], request_id=request_id)
    max_bytes = 6000  # parts of a few dozen calls; a long id leaves fewer per part, none over the limit
    out = trace_messages(head, calls, max_bytes)
    parts = [json.loads(value) for _, value in out]
    assert len(parts) > 3 and all(len(value) <= max_bytes for _, value in out)
    assert [(m["part"], m["parts"]) for m in parts] == [(i, len(parts)) for i in range(len(parts))]
    assert [c for m in parts for c in m["calls"]] == calls
    for m in parts:
        assert m["request_id"] == request_id and {k: m[k] for k in head} == head
        jsonschema.validate(m, schema)
    anomaly = {k: v for k, v in parts[0].items() if k != "request_id"}
    jsonschema.validate(anomaly, schema)  # a capture around an anomaly has none
    for bad in ("", 7, None):
        with pytest.raises(jsonschema.ValidationError) as err:
            jsonschema.validate({**anomaly, "request_id": bad}, schema)
        assert list(err.value.path) == ["request_id"]


def test_the_sink_stores_a_pieces_request_id_and_empty_for_an_anomalys_capture(pipeline_cfg, broker, store):
    cfg = replace(pipeline_cfg, kafka=broker.bootstrap)
    job = f"job-{uuid.uuid4().hex[:6]}"
    producer = Producer({"bootstrap.servers": broker.bootstrap})
    for head, calls in (capture_piece(job, 0, [NOW + i for i in range(3)], request_id="req-1"),
                        capture_piece(job, 1, [NOW + i for i in range(2)])):
        for key, value in trace_messages(head, calls, cfg.kafka_message_max_bytes):
            producer.produce(cfg.topic("traces"), value=value, key=key, headers=[("fs-schema", TRACE_SCHEMA.encode())])
    assert producer.flush(10) == 0
    sink = subscribed_sink(cfg, store, broker.bootstrap)
    try:
        deadline, stored = time.monotonic() + 60, 0
        while stored < 5:
            assert time.monotonic() < deadline, f"{stored} of 5 calls stored"
            sink.step(0.5)
            stored = int(store.query("SELECT count() AS n FROM trace_events").as_dicts()[0]["n"])
    finally:
        sink.consumer.close()
    rows = store.query("SELECT rank, request_id, count() AS n FROM trace_events FINAL WHERE job = {job:String} "
                       "GROUP BY rank, request_id", {"job": job}).as_dicts()
    assert {(int(r["rank"]), r["request_id"]): int(r["n"]) for r in rows} == {(0, "req-1"): 3, (1, ""): 2}
    assert sink.writer.stats.store_rejected == 0


def test_the_request_id_column_comes_with_a_fresh_store_and_to_one_migrated_to_012(tmp_path):
    at_012 = tmp_path / "sql"
    at_012.mkdir()
    for version, path in discover():
        if version <= 12:
            shutil.copy(path, at_012 / path.name)
    head, calls = capture_piece("train", 0, [NOW, NOW + 1000])
    anomaly = json.loads(trace_messages(head, calls, 1 << 20)[0][1])
    piece = json.loads(trace_messages({**head, "request_id": "req-1"}, calls, 1 << 20)[0][1])
    store = open_store(tmp_path / "upgraded", clickhouse_url=None, prefer_endpoint=False)
    try:
        assert apply(store, store.database, store.ttl_days, at_012)[-1] == "012_trace_events"
        old = trace_events_rows([(anomaly, NOW)])
        del old["request_id"]  # as a sink from before 013 wrote them
        store.insert("trace_events", old)
        applied = store.migrate()
        assert applied[0] == "013_trace_events_request_id" and all(int(name[:3]) > 12 for name in applied)
        assert store.column_types("trace_events")["request_id"] == "String"
        store.insert("trace_events", trace_events_rows([({**piece, "rank": 1}, NOW)]))
        rows = store.query("SELECT rank, request_id, count() AS n FROM trace_events GROUP BY rank, request_id")
        assert {(int(r["rank"]), r["request_id"]): int(r["n"]) for r in rows.as_dicts()} == {(0, ""): 2,
                                                                                            (1, "req-1"): 2}
    finally:
        store.close()
    store = open_store(tmp_path / "fresh", clickhouse_url=None, prefer_endpoint=False)
    try:
        assert "013_trace_events_request_id" in store.migrate()
        column = store.query("SELECT type, default_expression, comment FROM system.columns WHERE database = "
                             "{db:String} AND table = 'trace_events' AND name = 'request_id'",
                             {"db": store.database}).as_dicts()
        assert [(c["type"], c["default_expression"]) for c in column] == [("String", "''")]
        assert "live capture request" in column[0]["comment"]
    finally:
        store.close()
