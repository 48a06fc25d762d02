"""The detail gate (bpf/gpu_calls.bpf.c, GpuCallTracer.set_detail_until): a tracer built in detail mode sends
per-call records only while its gate is open, and its stats count every call either way. With
trace_capture_anomalies off, the agent's wiring (attach_capture -> TracingSource -> TracerManager -> tracer)
opens the gate only for a live capture request's span, and anomalies are not captured.

The CUDA libraries are stand-ins (src/fleetscope/eval/gpu_stub: this machine has no GPU); everything else is
real: uprobes, the BPF maps and ring buffer, /proc identities, the embedded broker, the tracer manager and
the capture. Time is polled with deadlines: the machine may be loaded."""
from __future__ import annotations

import json
import os
import threading
import time
import uuid
from dataclasses import replace

import pytest
from confluent_kafka import Producer

from fleetscope.capture_request import build_request, publish_request
from fleetscope.eval.gpu_stub.batches import index
from fleetscope.producers.agent import identity_rules
from fleetscope.producers.identity import IdentityResolver
from fleetscope.producers.trace_capture import attach_capture
from fleetscope.producers.tracers.gpu_calls import DETAIL_FOREVER
from fleetscope.producers.tracers.manager import TracerManager
from fleetscope.producers.tracers.registry import tracer_options
from fleetscope.producers.tracing_source import TracingSource
from support import gpu_fixtures as fixtures
from support.capture_topics import read_published, start_rank

make, stubs = fixtures.make, fixtures.stubs
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loading BPF programs needs root (CI runs as root)")
SYNC = ("cuda.calls", "cudaStreamSynchronize")


@pytest.fixture
def tracer_cls():
    from fleetscope.producers.tracers.cuda import CudaTracer
    return CudaTracer


def sample_for(tracer, pid: int, seconds: float) -> tuple[float, list[dict]]:
    """Samples over at least `seconds` (and at least two): the pid's synced calls counted, the records drained."""
    calls, records, n = 0.0, [], 0
    end = time.monotonic() + seconds
    while time.monotonic() < end or n < 2:
        calls += index([tracer.sample()], pid).get(SYNC, 0.0)
        records += tracer.records
        n += 1
        time.sleep(0.1)
    return calls, records


def test_records_flow_only_while_the_gate_is_open_and_stats_count_throughout(make):
    make_tracer, make_workload = make
    tracer = make_tracer(detail=True, detail_always=False)
    assert tracer.detail_until == 0
    w = start_rank(make_workload, tracer, "gate", 0, iters=100_000)  # runs until killed

    calls, records = sample_for(tracer, w.pid, 1.0)
    assert calls > 0 and records == [], "closed: counted, not recorded"

    open_s = 3.0
    until = time.monotonic_ns() + int(open_s * 1e9)
    until_wall = time.time_ns() + int(open_s * 1e9)
    assert tracer.set_detail_until(until) is True and tracer.detail_until == until
    got, deadline = [], time.monotonic() + 30
    while not got:
        assert time.monotonic() < deadline, "the open gate sent no records"
        tracer.sample()
        got += [r for r in tracer.records if r["pid"] == w.pid]
        time.sleep(0.1)
    while time.monotonic_ns() < until:  # the rest of the open span
        tracer.sample()
        got += [r for r in tracer.records if r["pid"] == w.pid]
        time.sleep(0.1)
    tracer.sample()  # what returned before the deadline, drained after it
    got += [r for r in tracer.records if r["pid"] == w.pid]
    assert {r["api"] for r in got} >= {"cudaStreamSynchronize"}
    assert all(r["ts_ns"] < until_wall + 100_000_000 for r in got), "a record of a call entered after the deadline"

    calls, records = sample_for(tracer, w.pid, 1.0)
    assert calls > 0 and records == [], "closed again after the deadline: counted, not recorded"

    assert tracer.set_detail_until(DETAIL_FOREVER) is True  # what trace_capture_anomalies does at start
    got, deadline = [], time.monotonic() + 30
    while not got:
        assert time.monotonic() < deadline, "the gate opened for good sent no records"
        tracer.sample()
        got += tracer.records
        time.sleep(0.1)
    assert tracer.set_detail_until(0) is True
    tracer.sample()
    calls, records = sample_for(tracer, w.pid, 0.5)
    assert calls > 0 and records == [], "0 closes it"


def test_a_tracer_without_detail_mode_sets_no_gate(make):
    make_tracer, _ = make
    tracer = make_tracer(detail=False)
    assert tracer.set_detail_until(time.monotonic_ns() + 10**9) is False and tracer.detail_until == 0


def test_a_request_before_the_manager_is_ready_opens_the_gate_when_it_arrives_and_the_latest_end_wins(
        make, pipeline_cfg):
    cfg = replace(pipeline_cfg, trace=("cuda",), trace_auto=False, trace_capture_s=10.0,
                  trace_capture_anomalies=False, trace_duty_period_s=3600.0)
    make_tracer, _ = make
    tracer = make_tracer(**tracer_options("cuda", cfg))
    compiled = threading.Event()  # stands for the BPF compile the agent's trace source waits on

    def make_manager():
        compiled.wait(30)
        return TracerManager(cfg, tracers={"cuda": tracer}, hit_cost_ns=6000.0)

    tracing = TracingSource(make_manager).start()
    try:
        now_wall, now_mono = time.time_ns(), time.monotonic_ns()
        tracing.open_detail(now_wall + 20 * 10**9)
        tracing.open_detail(now_wall + 5 * 10**9)  # a shorter request later: the longer end stands
        assert tracer.detail_until == 0, "no manager yet: nothing set"
        compiled.set()
        deadline = time.monotonic() + 30
        while tracer.detail_until == 0:
            assert time.monotonic() < deadline, "the manager arrived but the gate stayed shut"
            time.sleep(0.05)
        late = tracer.detail_until - now_mono
        assert 19 * 10**9 < late < 21 * 10**9, late  # wall converted to monotonic, the latest end
        tracing.open_detail(now_wall + 10 * 10**9)
        assert tracer.detail_until - now_mono == late
        tracing.open_detail(now_wall + 40 * 10**9)
        assert 39 * 10**9 < tracer.detail_until - now_mono < 41 * 10**9
    finally:
        compiled.set()
        tracing.close()


def publish_anomaly(cfg, bootstrap: str, job: str, rank: int, window_start_ns: int) -> None:
    a = {"tenant": cfg.default_tenant, "job": job, "host": cfg.host, "rank": rank, "window_start_ns": window_start_ns}
    producer = Producer({"bootstrap.servers": bootstrap})
    producer.produce(cfg.topic("anomalies"), value=json.dumps(a).encode(), key=f"{cfg.default_tenant}/{job}".encode(),
                     headers=[("fs-schema", b"anomaly/1")])
    assert producer.flush(10) == 0


def test_without_anomaly_capture_a_live_request_opens_the_gate_for_its_span_and_anomalies_are_ignored(
        make, pipeline_cfg, broker):
    # one duty period for the whole test: the governor must not shed the sync probes mid-test
    cfg = replace(pipeline_cfg, kafka=broker.bootstrap, trace=("cuda",), trace_auto=False, trace_capture_s=10.0,
                  trace_capture_anomalies=False, window_s=0.2, sample_interval_s=0.1, trace_request_max_s=5.0,
                  trace_budget=0.5, trace_duty_period_s=3600.0)
    options = tracer_options("cuda", cfg)
    assert options == {"detail": 10.0, "detail_always": False}  # what the agent's manager builds the tracer with
    make_tracer, make_workload = make
    tracer = make_tracer(**options)
    manager = TracerManager(cfg, tracers={"cuda": tracer}, hit_cost_ns=6000.0)
    tracing = TracingSource(lambda: manager).start()  # the agent's trace source, its manager running
    capture = None
    try:
        deadline = time.monotonic() + 30
        while tracing.manager is None:
            assert time.monotonic() < deadline, "the trace source never got its manager"
            time.sleep(0.05)
        capture = attach_capture(cfg, broker.bootstrap, IdentityResolver(identity_rules(cfg), host=cfg.host),
                                 [tracing])
        assert capture is not None and capture.open_detail == tracing.open_detail
        while not capture.ready.is_set():
            assert time.monotonic() < deadline, "the capture never read the anomalies and control topics"
            time.sleep(0.05)
        job = f"job-{uuid.uuid4().hex[:6]}"
        w = start_rank(make_workload, tracer, job, 0, iters=100_000)
        seen: list[dict] = []
        counted = [0.0]

        def tick():  # the agent's tick of the trace source
            counted[0] += index(tracing.sample(time.time_ns()), w.pid).get(SYNC, 0.0)
            seen.extend(r for r in tracer.records if r["pid"] == w.pid)
            time.sleep(cfg.sample_interval_s)

        end, deadline = time.monotonic() + 1.0, time.monotonic() + 30
        while time.monotonic() < end or counted[0] == 0:
            assert time.monotonic() < deadline, "the rank's calls were never counted"
            tick()
        assert seen == [] and capture.ring.added == 0, "the gate is closed before any request"

        req = build_request(job, 1.5, cfg.trace_request_max_s)
        publish_request(cfg, broker.bootstrap, req)  # as `fleetscope trace --live` does
        deadline = time.monotonic() + 60
        while capture.request_pieces < 1:
            assert time.monotonic() < deadline, capture.stats()
            tick()
        assert capture.requests == 1 and capture.detail_opened == 1 and capture.errors == 0
        # published once the trace source's tracer was drained past the piece, not at the ring's limit
        assert capture.published_early == 0 and capture.drained_ns >= req.to_ns + capture.settle_ns
        assert any(req.from_ns <= r["ts_ns"] <= req.to_ns for r in seen), "no records in the span: the gate is shut"
        assert min(r["ts_ns"] for r in seen) > req.requested_at_ns - 10**9, "records from before the request"

        # the gate closes after the span's end plus the settle time; the stats count on
        closes = req.to_ns + capture.settle_ns
        while time.time_ns() < closes + 200_000_000:
            tick()
        before, counted[0] = len(seen), 0.0
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            tick()
        assert len(seen) == before and counted[0] > 0, "closed after the span: counted, not recorded"
        assert all(r["ts_ns"] < closes + 100_000_000 for r in seen)

        # an anomaly of this rank inside the span, whose calls the ring holds: not captured
        publish_anomaly(cfg, broker.bootstrap, job, 0, (req.from_ns + req.to_ns) // 2 // 10**6 * 10**6)
        deadline = time.monotonic() + 60
        while capture.anomalies_ignored + capture.anomalies < 1:
            assert time.monotonic() < deadline, capture.stats()
            tick()
        for _ in range(10):  # past when it would have been due (its window's end + margin + settle: in the past)
            tick()
        assert capture.anomalies == 0 and capture.empty == 0 and capture.stats()["capture_anomalies_ignored"] == 1
    finally:
        if capture is not None:
            capture.close()
        tracing.close()

    got = read_published(cfg, broker.bootstrap, capture.published)  # the request's piece, and nothing for the anomaly
    assert capture.published == len(got) and capture.publish_errors == 0
    assert {(m["window_start_ns"], m["window_end_ns"]) for m in got} == {(req.from_ns, req.to_ns)}
    calls = {(c["tid"], c["api"], c["ts_ns"], c["dur_ns"]) for m in got for c in m["calls"]}
    assert calls == {(r["tid"], r["api"], r["ts_ns"], r["dur_ns"]) for r in seen if req.from_ns <= r["ts_ns"] <= req.to_ns}
