"""/metrics of the agent, the worker and the sink, in the Prometheus text format, parsed with prometheus_client's
own parser: scraped from a real `fleetscope up` run (embedded broker, sink and worker processes, agent), and
the worker's result series (score and threshold per rank, anomalies, diagnoses by KB entry) read from real
output topics on the real broker, then removed once their job goes idle. The sink's own counts (dead letters
by reason, store outage) have their test in test_sink_metrics.py."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import replace

import numpy as np
import pytest
from confluent_kafka import Producer
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from fleetscope import wire
from fleetscope.metrics_endpoint import MetricsEndpoint, read_metrics_url
from fleetscope.wire import Batch, StrColumn
from fleetscope.streams.worker_metrics import ResultMetrics, ResultReader


def scrape(url: str) -> dict[str, list]:
    """metric family name -> samples, from the Prometheus text format."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def wait_for(predicate, timeout_s: float, what: str, proc=None):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process ended while waiting for {what}")
        try:
            last = predicate()
        except (OSError, urllib.error.URLError, KeyError, IndexError):
            last = None
        if last:
            return last
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}; last={last}")


def value(families: dict, name: str, **labels) -> float:
    return sum(s.value for s in families[name] if all(s.labels.get(k) == v for k, v in labels.items())
               and s.name == (name + "_total" if s.name.endswith("_total") else name))


@pytest.mark.slow
def test_agent_and_worker_serve_metrics_during_fleetscope_up(tmp_path):
    """Waits are generous polls: a worker on a loaded machine has taken over 90 s to open its store."""
    env = {**os.environ, "FLEETSCOPE_DATA_DIR": str(tmp_path), "FLEETSCOPE_METRICS_PORT": "0",
           "FLEETSCOPE_SINK_METRICS_PORT": "0",
           "FLEETSCOPE_TRACE": "", "FLEETSCOPE_NVML": "false", "FLEETSCOPE_HOST": "metrics-test-host"}
    log = open(tmp_path / "up.log", "wb")
    up = subprocess.Popen([sys.executable, "-m", "fleetscope", "up", "--duration", "600", "--plain"], env=env,
                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        agent_url = wait_for(lambda: read_metrics_url(tmp_path, "agent"), 300, "the agent's /metrics", up)
        worker_url = wait_for(lambda: read_metrics_url(tmp_path, "worker"), 300, "the worker's /metrics", up)
        assert agent_url.startswith("http://127.0.0.1:") and worker_url.startswith("http://127.0.0.1:")
        agent = wait_for(lambda: (f := scrape(agent_url)) and
                         value(f, "fleetscope_agent_events_sent", host="metrics-test-host") > 0 and f,
                         300, "the agent to report events sent", up)
        assert value(agent, "fleetscope_agent_events_sampled") >= value(agent, "fleetscope_agent_events_sent")
        assert {s.labels["reason"] for s in agent["fleetscope_agent_dropped"]} == {
            "spool_overflow", "refused", "oversize_row"}
        assert "fleetscope_agent_spooled_batches" in agent and "fleetscope_agent_tracer_errors" in agent
        worker = wait_for(lambda: (f := scrape(worker_url)) and value(f, "fleetscope_worker_windows_out") > 0 and f,
                          300, "the worker to emit windows", up)
        assert value(worker, "fleetscope_worker_messages_in") > 0
        assert value(worker, "fleetscope_worker_dlq") == 0 and value(worker, "fleetscope_worker_store_errors") == 0
        assert worker["fleetscope_worker_event_time_lag_seconds"][0].value >= 0
        assert worker["fleetscope_worker_held_acks"][0].value >= 0  # acknowledgements waiting their turn
        flushes = [s for s in worker["fleetscope_worker_flush_seconds"] if s.name.endswith("_count")]
        assert flushes and flushes[0].value > 0  # the histogram times real flushes
        assert value(worker, "fleetscope_worker_dead_letters") == 0
        assert {x.labels["reason"] for x in worker["fleetscope_worker_dead_letters"]} >= {"decode", "other"}
        sink_url = wait_for(lambda: read_metrics_url(tmp_path, "sink"), 300, "the sink's /metrics", up)
        assert sink_url.startswith("http://127.0.0.1:") and sink_url not in (agent_url, worker_url)
        sink = wait_for(lambda: (f := scrape(sink_url)) and
                        value(f, "fleetscope_sink_rows_stored", table="raw_metrics") > 0 and f,
                        300, "the sink to store raw rows", up)
        assert value(sink, "fleetscope_sink_inserts", table="raw_metrics") > 0
        assert value(sink, "fleetscope_sink_store_unavailable") == 0
        assert value(sink, "fleetscope_sink_dead_letters") == 0
    finally:
        os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
    assert read_metrics_url(tmp_path, "agent") is None  # a stopped endpoint removes its note


def scores_message(tenant, job, ranks, score, threshold, roles) -> bytes:
    n = len(ranks)
    cols = {"window_start_ns": np.full(n, time.time_ns(), dtype="<i8"), "tenant": StrColumn.of([tenant] * n),
            "job": StrColumn.of([job] * n), "host": StrColumn.of([f"h{r % 2}" for r in ranks]),
            "rank": np.array(ranks, dtype="<i4"), "score": np.array(score, dtype="<f8"),
            "threshold": np.array(threshold, dtype="<f8"), "is_anomaly": np.array([bool(x) for x in roles], dtype="<u1"),
            "role": StrColumn.of(roles)}
    return wire.encode(Batch("scores", "worker-host", cols))


def test_result_series_follow_the_output_topics_and_expire_with_their_job(pipeline_cfg, broker):
    cfg = replace(pipeline_cfg, metrics_port=0, metrics_job_expire_s=2.0)
    registry = CollectorRegistry()
    results = ResultMetrics(registry, cfg.metrics_job_expire_s)
    endpoint = MetricsEndpoint.from_config(cfg, registry, "worker").start()
    reader = ResultReader(cfg, broker.bootstrap, results)
    reader.start()
    try:
        p = Producer({"bootstrap.servers": broker.bootstrap})

        def publish_all():
            p.produce(cfg.topic("scores"), key=b"acme/train-1",
                      value=scores_message("acme", "train-1", [0, 1, 2], [5.0, 21.0, 31.0], [20.0, 20.0, 20.0],
                                           ["", "waiting", "culprit"]))
            p.produce(cfg.topic("anomalies"), key=b"acme/train-1", value=json.dumps(
                {"tenant": "acme", "job": "train-1", "host": "h0", "rank": 2, "window_start_ns": 1,
                 "score": 31.0, "threshold": 20.0, "role": "culprit"}).encode())
            p.produce(cfg.topic("anomalies"), key=b"acme/train-1", value=json.dumps(
                {"tenant": "acme", "job": "train-1", "host": "h0", "rank": 0, "window_start_ns": 1,
                 "score": 25.0, "threshold": 20.0, "role": "node"}).encode())
            p.produce(cfg.topic("diagnoses"), key=b"acme/train-1", value=json.dumps(
                {"tenant": "acme", "job": "train-1", "host": "h0", "rank": 2, "window_start_ns": 1,
                 "matches": [{"kb_entry": "cpu_contention", "confidence": 0.8}]}).encode())
            p.produce(cfg.topic("anomalies"), key=b"acme/x", value=b"not json")
            assert p.flush(30) == 0

        # the reader starts at the latest offsets, and each output topic's partitions are assigned on their own
        # (under load the diagnoses topic came after the scores topic was seen): publish until it sees them
        def republished_until(ready):
            def poll():
                fams = scrape(endpoint.url)
                if ready(fams):
                    return fams
                publish_all()
                return None
            return poll
        wait_for(republished_until(lambda f: any(s.labels.get("job") == "train-1"
                                                 for s in f.get("fleetscope_rank_score", []))), 90, "the result series")
        # the anomalies topic's partitions too: once the scores and diagnoses were seen, a loaded CI run still read
        # no culprit anomaly (its partition assigned last)
        fams = wait_for(republished_until(lambda f: "fleetscope_diagnoses" in f and value(f, "fleetscope_diagnoses") > 0
                                          and "fleetscope_anomalies" in f and value(f, "fleetscope_anomalies",
                                                                                   tenant="acme", job="train-1",
                                                                                   role="culprit") >= 1),
                        90, "the diagnosis and anomaly counters")
        scores = {s.labels["rank"]: s for s in fams["fleetscope_rank_score"]}
        assert scores["2"].value == 31.0 and scores["0"].value == 5.0
        assert set(scores["2"].labels) == {"tenant", "job", "host", "rank", "role"}
        assert {r: s.labels["role"] for r, s in scores.items()} == {"0": "none", "1": "waiting", "2": "culprit"}
        assert scores["2"].labels["tenant"] == "acme" and scores["2"].labels["host"] == "h0"
        assert {s.labels["rank"]: s.value for s in fams["fleetscope_rank_threshold"]}["1"] == 20.0
        assert value(fams, "fleetscope_anomalies", tenant="acme", job="train-1", role="culprit") >= 1
        fams = wait_for(lambda: (f := scrape(endpoint.url)) and value(f, "fleetscope_anomalies", role="node") > 0
                        and f, 30, "the node anomaly")
        assert value(fams, "fleetscope_diagnoses", kb_entry="cpu_contention") >= 1
        assert value(fams, "fleetscope_result_metrics_bad_messages") >= 1

        # no more windows: after metrics_job_expire_s the job's series are gone
        wait_for(lambda: not any(s.labels.get("job") == "train-1"
                                 for name in ("fleetscope_rank_score", "fleetscope_anomalies", "fleetscope_diagnoses")
                                 for s in scrape(endpoint.url).get(name, [])), 60, "the idle job's series expired")
    finally:
        reader.stop()
        endpoint.stop()


def test_endpoint_binds_loopback_by_default_and_a_configured_address(tmp_path):
    registry = CollectorRegistry()
    Counter("fleetscope_probe_hits", "a test counter", registry=registry).inc(3)
    default = MetricsEndpoint(registry, "agent", "127.0.0.1", 0, tmp_path).start()
    other = MetricsEndpoint(registry, "worker", "127.0.0.2", 0, tmp_path).start()
    try:
        assert value(scrape(default.url), "fleetscope_probe_hits") == 3
        assert other.url.startswith("http://127.0.0.2:") and value(scrape(other.url), "fleetscope_probe_hits") == 3
        with pytest.raises(urllib.error.URLError):  # listening on its address only
            urllib.request.urlopen(f"http://127.0.0.1:{other.server.server_port}/metrics", timeout=5)
    finally:
        default.stop()
        other.stop()


def test_a_taken_port_falls_back_to_a_free_one_and_port_minus_one_is_off(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ep = MetricsEndpoint(CollectorRegistry(), "agent", "127.0.0.1", port, tmp_path).start()
        try:
            assert ep.server is not None and ep.server.server_port != port
            assert read_metrics_url(tmp_path, "agent") == ep.url
        finally:
            ep.stop()
    off = MetricsEndpoint(CollectorRegistry(), "agent", "127.0.0.1", -1, tmp_path).start()
    assert off.server is None and off.url is None
