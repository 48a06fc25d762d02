"""The whole pipeline with real parts: the tansu broker, the real node agent
reading this machine's /proc, a `fleetscope streams` process (Faust), and chDB."""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from fleetscope.schema import node_identity
from fleetscope.wire import Batch, StrColumn, encode
from fleetscope.producers.agent import build_agent

CPU_STATES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def proc_stat_total() -> tuple[float, float]:
    """(busy, total) jiffies of the aggregate cpu line, read independently of the agent."""
    with open("/proc/stat") as fh:
        fields = [float(x) for x in fh.readline().split()[1:9]]
    total = sum(fields)
    return total - fields[3] - fields[4], total


def run_agent(cfg, bootstrap, seconds):
    agent = build_agent(replace(cfg, kafka=bootstrap), bootstrap)
    thread = threading.Thread(target=agent.run, kwargs={"duration_s": seconds})
    thread.start()
    return agent, thread


def node_features(worker, host):
    return worker.query(
        "SELECT toUnixTimestamp64Nano(window_start), toUnixTimestamp64Nano(window_end), feature, sources "
        "FROM features WHERE tenant = '_node' AND job = {h:String} ORDER BY window_start", {"h": host}).rows


def test_agent_to_clickhouse_features_match_proc_stat(pipeline_cfg, streams_worker, broker):
    worker = streams_worker().start()
    busy0, total0 = proc_stat_total()
    agent, thread = run_agent(pipeline_cfg, broker.bootstrap, seconds=4.0)
    thread.join()
    busy1, total1 = proc_stat_total()
    worker.wait_for(lambda: worker.stats()["open_windows"] == 0 and len(node_features(worker, pipeline_cfg.host)) >= 3,
                    30, "windows to close")
    rows = node_features(worker, pipeline_cfg.host)
    busy_sum = total_sum = 0.0
    for start, end, feature, sources in rows:
        assert {"host", "agent"} <= set(sources) <= {"host", "agent", "nvml"}  # nvml: one status row here (no GPU)
        assert 0.0 <= feature["mem_used_frac"] <= 1.0
        deltas = dict(worker.query(
            "SELECT metric, sum(value) FROM raw_metrics WHERE job = {h:String} AND device = 'all' "
            "AND metric LIKE 'cpu.%' AND interval_ns > 0 AND ts >= fromUnixTimestamp64Nano({s:Int64}) "
            "AND ts < fromUnixTimestamp64Nano({e:Int64}) GROUP BY metric",
            {"h": pipeline_cfg.host, "s": start, "e": end}).rows)
        if "cpu_busy_frac" not in feature:
            assert not deltas  # masked only where the window had no cpu deltas (the very first tick)
            continue
        total = sum(deltas[f"cpu.{s}"] for s in CPU_STATES)
        busy = total - deltas["cpu.idle"] - deltas["cpu.iowait"]
        assert 0.0 <= feature["cpu_busy_frac"] <= 1.0
        assert feature["cpu_busy_frac"] == pytest.approx(busy / total, abs=1e-9)
        busy_sum += busy
        total_sum += total
    assert total_sum > 0
    # the agent's deltas cover a sub-span of the test's own /proc/stat reading
    assert busy_sum / total_sum == pytest.approx((busy1 - busy0) / (total1 - total0), abs=0.15)
    # nothing the agent sent is missing from the store (its rank processes' proc rows carry their own jobs)
    raw_rows = worker.query("SELECT count() FROM raw_metrics WHERE host = {h:String}", {"h": pipeline_cfg.host}).rows[0][0]
    assert raw_rows == agent.publisher.stats.events_sent
    assert agent.publisher.stats.dropped_events == 0


def synthetic_host_batch(host: str, ts_ns: int) -> Batch:
    names = tuple(f"cpu.{s}" for s in CPU_STATES)
    n = len(names)
    cols = {"ts_ns": np.full(n, ts_ns, dtype="<i8"), **node_identity(host, n),
            "metric": StrColumn(np.arange(n, dtype=np.uint32), names), "device": StrColumn.constant("all", n),
            "value": np.array([0.3, 0, 0.1, 0.6, 0, 0, 0, 0]), "interval_ns": np.full(n, 500_000_000, dtype="<i8")}
    return Batch("host", host, cols)


def test_bad_messages_land_in_the_dlq_and_the_worker_keeps_going(pipeline_cfg, streams_worker, broker):
    worker = streams_worker().start()
    topic = pipeline_cfg.raw_topic("host")
    key = f"_node/{pipeline_cfg.host}".encode()
    good = [synthetic_host_batch(pipeline_cfg.host, time.time_ns() - 4_000_000_000 + k * 500_000_000) for k in range(8)]
    truncated = encode(good[0])[:-12]
    corrupted = bytearray(encode(good[1]))
    corrupted[4] ^= 0x5A  # inside the codec's header
    # decodes, but its optional sample_frac is a string column: it failed after the decoder, escaped,
    # and Faust committed past it without a dead letter
    odd = synthetic_host_batch(pipeline_cfg.host, time.time_ns() - 3_000_000_000)
    odd.columns["sample_frac"] = StrColumn.constant("half", odd.count)
    producer = Producer({"bootstrap.servers": broker.bootstrap})
    for value in (b"\x00garbage that is not a batch at all", truncated, bytes(corrupted)):
        producer.produce(topic, key=key, value=value)
    producer.produce(topic, key=b"acme/not-this-node", value=encode(good[2]))  # a key that disagrees
    producer.produce(topic, key=key, value=encode(odd))
    for batch in good:
        producer.produce(topic, key=key, value=encode(batch), headers=batch.kafka_headers())
    assert producer.flush(10) == 0
    worker.wait_for(lambda: worker.query("SELECT count() FROM dlq").rows[0][0] == 5, 30, "five stored dead letters")
    assert worker.stats()["dlq"] == 5
    reasons = sorted(r[0] for r in worker.query("SELECT reason FROM dlq").rows)
    assert any("bad magic" in r for r in reasons)
    assert any("truncated" in r for r in reasons)
    assert any("message key 'acme/not-this-node' disagrees" in r for r in reasons)
    assert any("windowing failed: TypeError" in r for r in reasons)
    features = worker.wait_for(lambda: node_features(worker, pipeline_cfg.host), 30, "features after bad input")
    assert features[0][2]["cpu_busy_frac"] == pytest.approx(0.4)
    assert worker.proc.poll() is None
    # the dead letters are on the DLQ topic too, with the reason in a header
    consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "dlq-check", "fetch.wait.max.ms": 10})
    consumer.assign([TopicPartition(pipeline_cfg.topic("dlq"), p, 0) for p in range(pipeline_cfg.partitions)])
    got = []
    deadline = time.monotonic() + 10
    while len(got) < 5 and time.monotonic() < deadline:
        got += [m for m in consumer.consume(10, 0.5) if not m.error()]
    consumer.close()
    assert sorted(dict(m.headers())["fs-dlq-reason"].decode() for m in got) == reasons


def test_killed_worker_restarts_without_losing_or_duplicating_feature_rows(pipeline_cfg, streams_worker, broker):
    host = pipeline_cfg.host
    first = streams_worker().start()
    agent, thread = run_agent(pipeline_cfg, broker.bootstrap, seconds=14.0)
    first.wait_for(lambda: len(node_features(first, host)) >= 3, 40, "first feature rows")
    first.kill()  # SIGKILL mid-run: no flush, no commit, no goodbye
    second = streams_worker().start()
    thread.join()
    sent = agent.publisher.stats.events_sent

    def settled():
        s = second.stats()
        raw = second.query("SELECT count() FROM raw_metrics WHERE host = {h:String}", {"h": host}).rows[0][0]
        return s["open_windows"] == 0 and s["unacked_messages"] == 0 and raw == sent and raw

    second.wait_for(settled, 60, "the restarted worker to catch up")
    per_window = second.query(
        "SELECT toUnixTimestamp64Milli(window_start) AS w, count() FROM features WHERE job = {h:String} "
        "GROUP BY w ORDER BY w", {"h": host}).rows
    counts = [c for _, c in per_window]
    assert counts == [1] * len(counts), f"duplicated windows: {per_window}"
    starts = [w for w, _ in per_window]
    assert starts == list(range(starts[0], starts[-1] + 1000, 1000)), "a window is missing"
    assert len(starts) >= 12
    assert second.stats()["replayed_events"] > 0 or second.stats()["events_in"] < sent  # it really resumed
