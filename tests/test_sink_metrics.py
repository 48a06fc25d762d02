"""The sink's /metrics, and dead letters by reason category on the worker's and the sink's, scraped over HTTP
and parsed with prometheus_client's text parser.

- A real stack (the launcher's `fleetscope sink` and `fleetscope streams` processes on the embedded broker, the
  store a real chDB) is fed bad raw messages, which the worker dead-letters, and bad derived messages, which the
  sink dead-letters itself; each endpoint counts them by category, and the sink counts the rows it stored.
- A sink whose real chDB store is closed under it (every insert and the liveness query fail, as in an outage)
  shows the store as unavailable, with the failed inserts counted per table.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace

import numpy as np
from confluent_kafka import Consumer, Producer
from prometheus_client.parser import text_string_to_metric_families

from fleetscope.kafka_settings import client_conf
from fleetscope.metrics_endpoint import read_metrics_url
from fleetscope.wire import Batch, StrColumn, encode
from fleetscope.streams.derived_codec import ANOMALY_SCHEMA
from fleetscope.streams.dlq_reasons import CATEGORIES
from fleetscope.streams.sink.consumer import Sink, sink_topics
from fleetscope.streams.sink.sink_metrics import SinkMetrics
from support.wire_messages import metric_batch


def scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(families: dict, name: str, **labels) -> float:
    """The sum of a family's samples (the counter's `_total`, not its `_created`) matching labels."""
    return sum(s.value for s in families.get(name, ()) if not s.name.endswith("_created")
               and all(s.labels.get(k) == v for k, v in labels.items()))


def poll(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (OSError, urllib.error.URLError, KeyError):
            last = None
        if last:
            return last
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}; last={last}")


def host_batch(tenant: str, job: str, ts_ns: int) -> Batch:
    n = 3
    return Batch("host", "metrics-node", {
        "ts_ns": np.full(n, ts_ns, dtype="<i8"), "tenant": StrColumn.constant(tenant, n),
        "job": StrColumn.constant(job, n), "rank": np.zeros(n, dtype="<i4"), "pid": np.ones(n, dtype="<i4"),
        "gpu": np.zeros(n, dtype="<i2"), "metric": StrColumn.of(["cpu.user", "cpu.idle", "cpu.user"]),
        "device": StrColumn.constant("all", n), "value": np.ones(n), "interval_ns": np.full(n, 10**9, dtype="<i8")})


def anomaly(**changes) -> dict:
    return {"tenant": "acme", "job": "train", "host": "h0", "rank": 1, "window_start_ns": time.time_ns(),
            "score": 31.0, "threshold": 20.0, "detectors": ["gmm"], "contributions": {"x": 1.0}, "peer_z": {},
            "features": {}, **changes}


def test_worker_and_sink_count_dead_letters_by_reason_and_the_sink_its_rows(embedded_stack, pipeline_cfg, broker):
    """Waits are generous polls: a worker on a loaded machine has taken over 90 s to start."""
    cfg = replace(pipeline_cfg, sink_metrics_port=0)
    stack = embedded_stack(cfg=cfg)
    sink_url = poll(lambda: read_metrics_url(cfg.data_dir, "sink"), 120, "the sink's /metrics")
    worker_url = poll(lambda: read_metrics_url(cfg.data_dir, "worker"), 120, "the worker's /metrics")
    assert sink_url.startswith("http://127.0.0.1:") and sink_url != worker_url
    before = scrape(sink_url)
    assert {s.labels["reason"] for s in before["fleetscope_sink_dead_letters"] if s.name.endswith("_total")} \
        == set(CATEGORIES)  # every category there from the start, at 0
    assert value(before, "fleetscope_sink_dead_letters") == 0

    p = Producer({"bootstrap.servers": broker.bootstrap})
    raw = cfg.raw_topic("host")
    now = time.time_ns()
    p.produce(raw, key=b"acme/train", value=encode(host_batch("acme", "train", now)))  # stored
    p.produce(raw, key=b"acme/train", value=b"\x00 not an arrow stream")  # decode
    p.produce(raw, key=b"acme/other", value=encode(host_batch("acme", "train", now)))  # key_mismatch
    old = metric_batch()  # its events are from 2023: older than the retention
    p.produce(raw, key=f"{old.columns['tenant'].values[0]}/{old.columns['job'].values[0]}".encode(),
              value=encode(old))  # timestamp
    derived = cfg.topic("anomalies")
    schema = [("fs-schema", ANOMALY_SCHEMA.encode())]
    p.produce(derived, key=b"acme/train", value=json.dumps(anomaly()).encode(), headers=schema)  # stored
    p.produce(derived, key=b"acme/train", value=b"{not json", headers=schema)  # decode
    p.produce(derived, key=b"acme/train", value=json.dumps(anomaly()).encode(),
              headers=[("fs-schema", b"anomaly/0")])  # schema
    bad_row = anomaly()
    del bad_row["detectors"]  # reads as JSON, but its row cannot be built: refused, retried, dead-lettered
    p.produce(derived, key=b"acme/train", value=json.dumps(bad_row).encode(), headers=schema)  # store_refused
    assert p.flush(30) == 0

    worker = poll(lambda: (f := scrape(worker_url)) and value(f, "fleetscope_worker_dead_letters") >= 3 and f,
                  180, "the worker's dead letters")
    assert {c: value(worker, "fleetscope_worker_dead_letters", reason=c) for c in CATEGORIES} == {
        "decode": 1, "schema": 0, "key_mismatch": 1, "timestamp": 1, "store_refused": 0, "handler_error": 0,
        "other": 0}

    def sink_done():
        f = scrape(sink_url)
        return (value(f, "fleetscope_sink_dead_letters") >= 3 and value(f, "fleetscope_sink_rows_stored",
                table="dlq") >= 6 and value(f, "fleetscope_sink_rows_stored", table="raw_metrics") >= 3
                and value(f, "fleetscope_sink_store_unavailable") == 0 and f)
    sink = poll(sink_done, 180, "the sink to store the rows and the six dead letters")
    assert {c: value(sink, "fleetscope_sink_dead_letters", reason=c) for c in CATEGORIES} == {
        "decode": 1, "schema": 1, "key_mismatch": 0, "timestamp": 0, "store_refused": 1, "handler_error": 0,
        "other": 0}
    assert value(sink, "fleetscope_sink_rows_stored", table="anomalies") >= 1
    assert value(sink, "fleetscope_sink_inserts", table="raw_metrics") >= 1
    assert value(sink, "fleetscope_sink_dlq_rows") == 3  # the ones it made itself, stored by it
    assert value(sink, "fleetscope_sink_records") >= 8
    assert value(sink, "fleetscope_sink_poll_plan_replays") == 0
    assert value(sink, "fleetscope_sink_commits") >= 1
    # librdkafka's statistics come every LAG_STATS_MS and know a partition's lag from its first commit. A
    # statistics report can predate the sink's last commit (a loaded CI run read a lag of 1 once), so the lag
    # is waited on until every message the test sent shows as taken and committed
    lags = []

    def committed_lag():
        g = {s.labels["topic"]: s.value for s in scrape(sink_url).get("fleetscope_sink_consumer_lag_messages", ())}
        lags.append(g)
        return raw in g and derived in g and g[raw] == 0 and g[derived] == 0 and g

    try:
        lag = poll(committed_lag, 60, "a consumer lag of 0 on the topics the sink committed")
    except AssertionError as e:
        raise AssertionError(f"{e}; the last lags read: {lags[-3:]}") from None
    assert all(v >= 0 for v in lag.values())
    assert [s for s in sink["fleetscope_sink_insert_seconds"] if s.name.endswith("_count")][0].value >= 1
    # the stored rows and dead letters are the ones counted
    assert stack.query("SELECT count() FROM dlq").rows[0][0] >= 6


def test_a_store_that_stopped_answering_shows_as_unavailable_with_failed_inserts(pipeline_cfg, broker, store):
    """The Sink and the metrics as run_sink wires them, on a real consumer and a real chDB store, which the
    test closes: from then on every insert and the liveness query fail, as in a store outage."""
    cfg = replace(pipeline_cfg, sink_metrics_port=0)
    metrics = SinkMetrics(cfg, store)
    consumer = Consumer(client_conf(cfg, broker.bootstrap, **{
        "group.id": f"{cfg.consumer_group}-sink", "enable.auto.commit": False, "auto.offset.reset": "earliest",
        "fetch.wait.max.ms": 50, **metrics.consumer_settings()}))
    sink = Sink(cfg, metrics.store, consumer)
    metrics.watch(sink)
    consumer.subscribe(sink_topics(cfg), on_assign=sink.on_assign)
    metrics.start()
    stop = threading.Event()
    loop = threading.Thread(target=sink.run, args=(stop,), daemon=True)
    loop.start()
    try:
        p = Producer({"bootstrap.servers": broker.bootstrap})
        schema = [("fs-schema", ANOMALY_SCHEMA.encode())]
        p.produce(cfg.topic("anomalies"), key=b"acme/train", value=json.dumps(anomaly()).encode(), headers=schema)
        assert p.flush(30) == 0
        poll(lambda: value(scrape(metrics.endpoint.url), "fleetscope_sink_rows_stored", table="anomalies") >= 1,
             90, "the first anomaly stored")
        up = scrape(metrics.endpoint.url)
        assert value(up, "fleetscope_sink_store_unavailable") == 0
        assert value(up, "fleetscope_sink_insert_failures") == 0

        store.close()
        p.produce(cfg.topic("anomalies"), key=b"acme/train", value=json.dumps(anomaly(rank=2)).encode(),
                  headers=schema)
        assert p.flush(30) == 0
        down = poll(lambda: (f := scrape(metrics.endpoint.url)) and value(f, "fleetscope_sink_store_unavailable") == 1
                    and value(f, "fleetscope_sink_insert_failures", table="anomalies") >= 2 and f,
                    90, "the sink to see the store gone and keep retrying")
        assert value(down, "fleetscope_sink_store_down_seconds") > 0
        assert value(down, "fleetscope_sink_rows_stored", table="anomalies") == 1  # nothing counted as stored
        assert value(down, "fleetscope_sink_dead_letters") == 0  # an outage is retried, never dead-lettered
    finally:
        stop.set()
        loop.join(30)
        metrics.stop()
        consumer.close()
