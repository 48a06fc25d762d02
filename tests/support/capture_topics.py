"""What the capture tests share: the agent's tracer and capture wired as its tick wires them, a stand-in rank
the CUDA tracer follows, `<prefix>.traces` read back, and made-up captures (a live request's piece, an anomaly's
capture) for the sink and the store."""
from __future__ import annotations

import json
import time
import uuid

from confluent_kafka import Consumer

from fleetscope.producers.agent import identity_rules
from fleetscope.producers.identity import IdentityResolver
from fleetscope.producers.trace_capture import TraceCapture
from fleetscope.producers.tracers.manager import TracerManager
from fleetscope.trace_message import call_of


def capturing_agent(make_tracer, cfg, bootstrap):
    """(tracer, manager, capture): the CUDA tracer in detail mode, the agent's manager (not started: the test
    ticks it) handing its records to a started capture that reads the anomalies and control topics."""
    tracer = make_tracer(detail=True)
    manager = TracerManager(cfg, tracers={"cuda": tracer}, hit_cost_ns=6000.0)
    capture = TraceCapture(cfg, bootstrap, IdentityResolver(identity_rules(cfg), host=cfg.host)).start()
    manager.on_records = capture.add_records  # as TracingSource hands them over on the agent's tick
    manager.on_drained = capture.drained
    deadline = time.monotonic() + 30
    while not capture.ready.is_set():
        assert time.monotonic() < deadline, "the capture never read the anomalies and control topics"
        time.sleep(0.05)
    return tracer, manager, capture


def start_rank(make_workload, tracer, job: str, rank: int, iters: int):
    """A stand-in rank that sleeps 4 ms in every cudaStreamSynchronize, traced and released."""
    w = make_workload("cuda", iters, 0, late_load=True, env={
        "GPU_STUB_DELAY_US": "cudaStreamSynchronize=4000", "FLEETSCOPE_JOB": job, "RANK": str(rank)})
    w.load()
    w.loaded()
    assert tracer.add_pid(w.pid) is True
    w.go()
    return w


def read_published(cfg, bootstrap: str, count: int, timeout_s: float = 60.0) -> list[dict]:
    """The first `count` messages of `<prefix>.traces`, and a check that no more follow."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"read-{uuid.uuid4().hex[:6]}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([cfg.topic("traces")])
    got, deadline = [], time.monotonic() + timeout_s
    try:
        while len(got) < count:
            assert time.monotonic() < deadline, f"{len(got)} of {count} captures on {cfg.topic('traces')}"
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                got.append(json.loads(msg.value()))
        more = consumer.poll(1.0)
        assert more is None or more.error() is not None, more.value()[:200]
    finally:
        consumer.close()
    return got


def capture_piece(job: str, rank: int, ts_ns: list[int], request_id: str | None = None, tenant: str = "acme",
                  host: str = "node-1") -> tuple[dict, list[dict]]:
    """(head, calls) for trace_message.trace_messages: one 1 us cudaLaunchKernel of rank's process per ts_ns,
    the span they cover as window and span; a live request's piece with request_id, else an anomaly's capture."""
    lo, hi = min(ts_ns), max(ts_ns)
    head = {"tenant": tenant, "job": job, "host": host, "rank": rank, "window_start_ns": lo, "window_end_ns": hi,
            "from_ns": lo, "to_ns": hi}
    if request_id is not None:
        head["request_id"] = request_id
    calls = [call_of({"api": "cudaLaunchKernel", "pid": 1000 + rank, "tid": 7, "ts_ns": t, "dur_ns": 1000,
                      "kernel": "gemm", "grid": (4, 1, 1)}, "cuda") for t in ts_ns]
    return head, calls
