"""Live capture requests (fleetscope/capture_request.py, `<prefix>.control`): the message's checks, and end to
end as tests/test_trace_capture.py does it for anomalies: the real CUDA tracer in detail mode on a stand-in rank
(src/fleetscope/eval/gpu_stub), the real TracerManager and TraceCapture on the embedded broker, a request
published as `fleetscope trace --live` publishes it, `<prefix>.traces` read back in pieces, the real sink
storing them in chDB's trace_events; and `fleetscope trace --live` itself, reading the store through the query
endpoint while the test runs the agent's ticks and the sink."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from importlib.resources import files

import jsonschema
import pytest
from confluent_kafka import Producer

from fleetscope.capture_request import (CAPTURE_REQUEST_SCHEMA, CaptureRequest, CaptureRequestError, build_request,
                                        check_request, parse_request, publish_request)
from fleetscope.cli.trace import LIVE_GRACE_S, read_stored, wait_for_calls
from fleetscope.store import QueryEndpoint, open_store
from fleetscope.streams.sink.trace_rows import trace_events_rows
from fleetscope.trace_message import trace_messages
from support import gpu_fixtures as fixtures
from support.capture_topics import capture_piece, capturing_agent, read_published, start_rank
from support.subscribed_sink import subscribed_sink

make, stubs = fixtures.make, fixtures.stubs
NOW = 1_800_000_000_000_000_000
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="loading BPF programs needs root (CI runs as root)")


@pytest.fixture
def tracer_cls():  # the tracer the gpu fixtures make
    from fleetscope.producers.tracers.cuda import CudaTracer
    return CudaTracer


def fields(**kw) -> dict:
    return {"request_id": "r1", "tenant": "", "job": "train", "rank": -1, "from_ns": NOW, "to_ns": NOW + 10**9,
            "requested_at_ns": NOW, **kw}


def test_a_built_request_round_trips_and_meets_its_json_schema():
    req = build_request("train", 2.5, max_s=300, tenant="acme", rank=3, now_ns=NOW)
    assert (req.from_ns, req.to_ns, req.requested_at_ns, req.rank) == (NOW, NOW + 2_500_000_000, NOW, 3)
    key, value, headers = req.message()
    assert key == b"acme/train" and headers == [("fs-schema", CAPTURE_REQUEST_SCHEMA.encode())]
    schema = json.loads(files("fleetscope.schemas").joinpath("capture_request.schema.json").read_text())
    jsonschema.validate(json.loads(value), schema)
    assert parse_request(value, dict(headers), max_s=300) == req
    assert req.matches(("acme", "train", 3)) and not req.matches(("acme", "train", 2))
    assert not req.matches(("other", "train", 3)) and not req.matches(("acme", "eval", 3))
    anyone = check_request(fields(), max_s=300)
    assert anyone.matches(("t1", "train", 0)) and anyone.matches(("t2", "train", 7))


@pytest.mark.parametrize("bad, says", [
    (fields(extra=1), "unknown fields ['extra']"),
    ({k: v for k, v in fields().items() if k != "job"}, "missing fields ['job']"),
    (fields(to_ns=NOW), "must be after from_ns"),
    (fields(to_ns=NOW - 1), "must be after from_ns"),
    (fields(to_ns=NOW + 301 * 10**9), "longer than trace_request_max_s=300"),
    (fields(rank=True), "rank=True: must be an integer"),
    (fields(from_ns="1"), "from_ns='1': must be an integer"),
    (fields(rank=-2), "rank=-2"),
    (fields(job=""), "must not be empty"),
    ([1, 2], "is a JSON object"),
])
def test_an_invalid_request_says_what_is_wrong(bad, says):
    with pytest.raises(CaptureRequestError) as err:
        check_request(bad, max_s=300)
    assert says in str(err.value)


def test_a_message_of_another_schema_or_not_json_is_refused_and_the_builder_bounds_the_span():
    value = json.dumps(fields()).encode()
    with pytest.raises(CaptureRequestError, match="fs-schema 'anomaly/1'"):
        parse_request(value, {"fs-schema": b"anomaly/1"}, max_s=300)
    with pytest.raises(CaptureRequestError, match="not JSON"):
        parse_request(b"{nope", {"fs-schema": CAPTURE_REQUEST_SCHEMA.encode()}, max_s=300)
    with pytest.raises(CaptureRequestError, match="longer than trace_request_max_s=60"):
        build_request("train", 61, max_s=60)


def test_the_command_refuses_a_span_over_the_maximum_and_an_anomaly(tmp_path):
    env = {**os.environ, "FLEETSCOPE_DATA_DIR": str(tmp_path), "FLEETSCOPE_KAFKA": "127.0.0.1:1",
           "FLEETSCOPE_TRACE_REQUEST_MAX_S": "10"}
    for args, says in ((["--job", "train", "--seconds", "11"], "longer than trace_request_max_s=10"),
                       (["--anomaly", "t/j/0/1"], "--live takes --job")):
        run = subprocess.run([sys.executable, "-m", "fleetscope", "trace", *args, "--live", "--out",
                              str(tmp_path / "t.json")], env=env, capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and says in run.stderr, run.stderr


def test_waiting_for_calls_ends_at_its_deadline_on_a_store_without_them(store):
    now = [NOW]
    slept: list[float] = []

    def sleep(s):
        slept.append(s)
        now[0] += int(s * 1e9)

    params = {"job": "nobody", "tenant": "", "rank": -1, "since_ns": NOW, "until_ns": NOW + 10**9}
    assert wait_for_calls(store, params, NOW + 10**9, clock_ns=lambda: now[0], sleep=sleep) == 0
    assert now[0] >= NOW + 10**9 + LIVE_GRACE_S * 1e9  # it waited for the span to settle, then the grace
    assert now[0] <= NOW + 10**9 + (LIVE_GRACE_S + 1) * 1e9 and max(slept) <= 0.5


def test_a_request_waits_for_and_exports_its_own_calls_only(store):
    """Beside the request's piece, the store holds calls of the same job, rank and span that an anomaly's capture
    and another user's request brought: the command counts and exports the request's own, the stored path all."""
    for k, (request_id, n) in enumerate((("mine", 3), (None, 4), ("theirs", 5))):  # interleaved, distinct calls
        head, calls = capture_piece("train", 0, [NOW + i * 10**6 + k for i in range(n)], request_id=request_id)
        pieces = [(json.loads(value), NOW) for _, value in trace_messages(head, calls, 1 << 20)]
        store.insert("trace_events", trace_events_rows(pieces))
    params = {"job": "train", "tenant": "", "rank": 0, "since_ns": NOW, "until_ns": NOW + 10**9}
    late = lambda: NOW + int((LIVE_GRACE_S + 1) * 1e9)  # noqa: E731  past the deadline: it counts once, at once
    assert wait_for_calls(store, {**params, "request_id": "mine"}, NOW, clock_ns=late) == 3
    assert len(read_stored(store, {**params, "request_id": "mine"}, False)["calls"]) == 3
    assert wait_for_calls(store, {**params, "request_id": "theirs"}, NOW, clock_ns=late) == 5
    assert wait_for_calls(store, params, NOW, clock_ns=late) == 12  # without one: any capture's, as the stored path
    assert len(read_stored(store, {**params, "request_id": ""}, False)["calls"]) == 12


def drain_into_store(cfg, bootstrap: str, want: int) -> list[dict]:
    store = open_store(cfg.data_dir, clickhouse_url=None, prefer_endpoint=False)
    try:
        store.migrate()
        sink = subscribed_sink(cfg, store, bootstrap)
        deadline, stored = time.monotonic() + 60, 0
        while stored < want and time.monotonic() < deadline:
            sink.step(0.5)
            stored = int(store.query("SELECT count() AS n FROM trace_events").as_dicts()[0]["n"])
        sink.consumer.close()
        return store.query("SELECT tenant, job, host, rank, pid, tid, api, toUnixTimestamp64Nano(ts) AS ts_ns, dur_ns,"
                           " toUnixTimestamp64Milli(window_start) AS w_ms, request_id FROM trace_events FINAL"
                           ).as_dicts()
    finally:
        store.close()


@needs_root
def test_a_request_publishes_the_jobs_calls_in_pieces_which_the_sink_stores(make, pipeline_cfg, broker):
    # ring of 3 s: pieces of at most 1.5 s; a 3.2 s span is 3 pieces (1.5, 1.5, 0.2 s)
    cfg = replace(pipeline_cfg, kafka=broker.bootstrap, trace_capture_s=3.0, window_s=0.2, sample_interval_s=0.1,
                  trace_request_max_s=5.0)
    job = f"job-{uuid.uuid4().hex[:6]}"
    make_tracer, make_workload = make
    tracer, manager, capture = capturing_agent(make_tracer, cfg, broker.bootstrap)
    try:
        w = start_rank(make_workload, tracer, job, 0, iters=1500)  # about 6 s of 4 ms syncs
        seen: list[dict] = []

        def tick():
            manager.sample(time.time_ns())
            seen.extend(tracer.records)
            time.sleep(cfg.sample_interval_s)

        for _ in range(3):
            tick()
        req = build_request(job, 3.2, cfg.trace_request_max_s)
        publish_request(cfg, broker.bootstrap, req)  # as `fleetscope trace --live` does
        publish_request(cfg, broker.bootstrap, build_request("not-here", 1.0, cfg.trace_request_max_s))
        producer = Producer({"bootstrap.servers": broker.bootstrap})
        too_long = CaptureRequest("r-long", "", job, -1, req.from_ns, req.from_ns + 6 * 10**9, req.from_ns)
        key, value, headers = too_long.message()  # the class builds it unchecked, as another sender might
        producer.produce(cfg.topic("control"), value=value, key=key, headers=headers)
        producer.produce(cfg.topic("control"), value=b"{nope", key=key, headers=headers)
        assert producer.flush(10) == 0
        deadline = time.monotonic() + 60
        while capture.request_pieces < 3 or capture.requests + capture.requests_invalid < 4:
            assert time.monotonic() < deadline, capture.stats()
            tick()
        assert w.proc.poll() is None, "the rank ended before the span did: the last piece is not a full one"
        assert capture.requests == 2 and capture.requests_invalid == 2 and capture.errors == 0
        assert capture.stats()["capture_requests_invalid"] == 2
    finally:
        capture.close()
        manager.close()

    piece = 1_500_000_000
    pieces = [(req.from_ns, req.from_ns + piece - 1), (req.from_ns + piece, req.from_ns + 2 * piece - 1),
              (req.from_ns + 2 * piece, req.to_ns)]
    mine = [r for r in seen if r["pid"] == w.pid]
    want = {(r["pid"], r["tid"], r["api"], r["ts_ns"], r["dur_ns"])
            for r in mine if req.from_ns <= r["ts_ns"] <= req.to_ns}
    assert 0 < len(want) < len(mine)
    got = read_published(cfg, broker.bootstrap, capture.published)  # and no more: not the other job's, not twice
    assert {(m["window_start_ns"], m["window_end_ns"]) for m in got} == set(pieces)
    schema = json.loads(files("fleetscope.schemas").joinpath("trace.schema.json").read_text())
    for m in got:
        jsonschema.validate(m, schema)  # a piece is a trace/1 message like an anomaly's capture
        assert m["request_id"] == req.request_id  # the request it answers, in every piece and part
        assert (m["tenant"], m["job"], m["host"], m["rank"]) == (cfg.default_tenant, job, cfg.host, 0)
        assert (m["from_ns"], m["to_ns"]) == (m["window_start_ns"], m["window_end_ns"])
        assert all(m["from_ns"] <= c["ts_ns"] <= m["to_ns"] for c in m["calls"])
    calls = [c for m in got for c in m["calls"]]
    missing = sorted(want - {(c["pid"], c["tid"], c["api"], c["ts_ns"], c["dur_ns"]) for c in calls})
    before_end_ms = sorted({(hi - m[3]) // 10**6 for m in missing for lo, hi in pieces if lo <= m[3] <= hi})
    assert not missing, (f"{len(missing)} of {len(want)} calls not published, starting this many ms before their "
                         f"piece's end: {before_end_ms}; the capture's stats: {capture.stats()}")
    assert len(calls) == len(want)
    assert capture.published == len(got) and capture.publish_errors == 0 and capture.request_pieces == 3

    rows = drain_into_store(cfg, broker.bootstrap, len(want))
    assert {(r["tenant"], r["job"], r["host"], int(r["rank"])) for r in rows} == \
        {(cfg.default_tenant, job, cfg.host, 0)}
    assert {(int(r["pid"]), int(r["tid"]), r["api"], int(r["ts_ns"]), int(r["dur_ns"])) for r in rows} == want
    assert {int(r["w_ms"]) for r in rows} == {start // 10**6 for start, _ in pieces}  # filed under their pieces
    assert {r["request_id"] for r in rows} == {req.request_id}


@needs_root
def test_trace_live_requests_waits_and_exports_the_span(make, pipeline_cfg, broker, tmp_path):
    cfg = replace(pipeline_cfg, kafka=broker.bootstrap, trace_capture_s=4.0, window_s=0.2, sample_interval_s=0.1)
    job = f"job-{uuid.uuid4().hex[:6]}"
    make_tracer, make_workload = make
    tracer, manager, capture = capturing_agent(make_tracer, cfg, broker.bootstrap)
    store = open_store(cfg.data_dir, clickhouse_url=None, prefer_endpoint=False)
    store.migrate()
    endpoint = QueryEndpoint(store, cfg.data_dir).start()  # the CLI reads the store through it, as beside `up`
    out = tmp_path / "live.json"
    env = {**os.environ, "FLEETSCOPE_DATA_DIR": str(cfg.data_dir), "FLEETSCOPE_KAFKA": broker.bootstrap,
           "FLEETSCOPE_TOPIC_PREFIX": cfg.topic_prefix, "FLEETSCOPE_SAMPLE_INTERVAL_S": "0.1"}
    try:
        w = start_rank(make_workload, tracer, job, 1, iters=100_000)  # runs until killed
        sink = subscribed_sink(cfg, store, broker.bootstrap)
        cli = subprocess.Popen([sys.executable, "-m", "fleetscope", "trace", "--job", job, "--rank", "1",
                                "--seconds", "2", "--live", "--out", str(out)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 90
        while cli.poll() is None:  # the agent's ticks and the sink, while the command waits
            assert time.monotonic() < deadline, "fleetscope trace --live did not finish"
            manager.sample(time.time_ns())
            sink.step(0.1)
        stdout, stderr = cli.communicate()
        sink.consumer.close()
        w.kill()
        assert cli.returncode == 0, stderr
        assert f"requested 2 s of calls of job {job} (rank 1) from the agents" in stdout
        assert capture.requests == 1 and capture.request_pieces >= 1 and capture.errors == 0
        trace_events = store.query("SELECT min(toUnixTimestamp64Nano(ts)) AS lo, max(toUnixTimestamp64Nano(ts)) "
                                   "AS hi, count() AS n, groupUniqArray(request_id) AS ids FROM trace_events FINAL"
                                   ).as_dicts()[0]
    finally:
        endpoint.stop()
        store.close()
        capture.close()
        manager.close()
    assert int(trace_events["n"]) > 0 and int(trace_events["hi"]) - int(trace_events["lo"]) <= 2 * 10**9
    assert f"{int(trace_events['n'])} calls, 0 anomaly windows" in stdout, stdout
    assert len(trace_events["ids"]) == 1 and f"(request {trace_events['ids'][0]})" in stdout  # the request's own
    spans = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X" and e["cat"] == "cuda"]
    assert len(spans) == int(trace_events["n"]) and {e["pid"] for e in spans} == {1}
    assert all(int(trace_events["lo"]) / 1000 <= e["ts"] <= int(trace_events["hi"]) / 1000 for e in spans)
