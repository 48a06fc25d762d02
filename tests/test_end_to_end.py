"""The whole pipeline with real parts: the tansu broker, the real node agent
reading this machine's /proc, `fleetscope streams` worker processes (Faust) that
compute and publish, and a `fleetscope sink` process that stores every topic in chDB
(the launcher's stack, cli/launcher.py)."""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from fleetscope.cli.launcher import StackError
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


def node_features(stack, host):
    return stack.query(
        "SELECT toUnixTimestamp64Nano(window_start), toUnixTimestamp64Nano(window_end), feature, sources "
        "FROM features WHERE tenant = '_node' AND job = {h:String} ORDER BY window_start", {"h": host}).rows


def raw_rows(stack, host) -> int:
    return stack.query("SELECT count() FROM raw_metrics WHERE host = {h:String}", {"h": host}).rows[0][0]


def progress(stack, host) -> dict:
    """Where the pipeline stands, read in data-path order: the workers first, then the sink, so that a
    sink lag of 0 read last covers everything the workers had published when they were read."""
    out = {"worker_lag": stack.worker_lag(), "workers": stack.worker_stats()}
    out["raw_rows"] = raw_rows(stack, host)
    out["sink_lag"] = stack.sink_lag()
    return out


def wait_settled(stack, host, sent: int, timeout_s: float, what: str, also=lambda: True) -> None:
    """Every event the agent sent is stored, the workers committed all raw input with no window open or
    unacknowledged, and the sink stored everything published (its offsets are at the end of every topic)."""
    state = {}

    def done():
        state.update(progress(stack, host))
        w = state["workers"]
        return (state["worker_lag"] == 0 and w is not None and w["open_windows"] == 0 and w["unacked_messages"] == 0
                and state["raw_rows"] >= sent and state["sink_lag"] == 0 and also())
    try:
        stack.wait_for(done, timeout_s, what)
    except StackError as exc:
        raise AssertionError(f"{exc}\nsent {sent}, state {state}") from None


def test_agent_to_clickhouse_features_match_proc_stat(pipeline_cfg, embedded_stack, broker):
    stack = embedded_stack()
    busy0, total0 = proc_stat_total()
    agent, thread = run_agent(pipeline_cfg, broker.bootstrap, seconds=4.0)
    thread.join()
    busy1, total1 = proc_stat_total()
    sent = agent.publisher.stats.events_sent
    wait_settled(stack, pipeline_cfg.host, sent, 60, "windows to close and be stored",
                 also=lambda: len(node_features(stack, pipeline_cfg.host)) >= 3)
    rows = node_features(stack, pipeline_cfg.host)
    busy_sum = total_sum = 0.0
    for start, end, feature, sources in rows:
        assert {"host", "agent"} <= set(sources) <= {"host", "agent", "nvml"}  # nvml: one status row here (no GPU)
        assert 0.0 <= feature["mem_used_frac"] <= 1.0
        deltas = dict(stack.query(
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
    assert raw_rows(stack, pipeline_cfg.host) == sent
    assert agent.publisher.stats.dropped_events == 0
    # the Faust consumer told the worker where each message's partition ends (windows.py: idle closing waits
    # for a backlog instead of dropping it as late); none was handled blind
    workers = stack.worker_stats()
    assert workers["messages_in"] > 0 and workers["partition_end_unknown"] == 0, workers


def synthetic_host_batch(host: str, ts_ns: int) -> Batch:
    names = tuple(f"cpu.{s}" for s in CPU_STATES)
    n = len(names)
    cols = {"ts_ns": np.full(n, ts_ns, dtype="<i8"), **node_identity(host, n),
            "metric": StrColumn(np.arange(n, dtype=np.uint32), names), "device": StrColumn.constant("all", n),
            "value": np.array([0.3, 0, 0.1, 0.6, 0, 0, 0, 0]), "interval_ns": np.full(n, 500_000_000, dtype="<i8")}
    return Batch("host", host, cols)


def test_bad_messages_land_in_the_dlq_and_the_worker_keeps_going(pipeline_cfg, embedded_stack, broker):
    stack = embedded_stack()
    topic = pipeline_cfg.raw_topic("host")
    key = f"_node/{pipeline_cfg.host}".encode()
    good = [synthetic_host_batch(pipeline_cfg.host, time.time_ns() - 4_000_000_000 + k * 500_000_000) for k in range(8)]
    truncated = encode(good[0])[:-12]
    corrupted = bytearray(encode(good[1]))
    corrupted[4] ^= 0x5A  # inside the codec's header
    # decodes, but its optional sample_frac is a string column: refused once, by schema.validate (the worker
    # and the sink both use it), not by the worker's windowing and then again by the sink's insert
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
    # The worker dead-letters five, each once with its reason; the sink skips them (it stores nothing twice).
    stack.wait_for(lambda: stack.query("SELECT count() FROM dlq").rows[0][0] >= 5, 30, "five stored dead letters")
    stack.wait_for(lambda: stack.worker_stats()["dlq"] >= 5, 10, "the worker's counters (written every second)")
    assert stack.worker_stats()["dlq"] == 5
    stored = stack.query("SELECT reason, partition, offset FROM dlq ORDER BY reason").rows
    assert len(stored) == 5, "\n".join(map(str, stored))
    assert len({(p, o) for _, p, o in stored}) == 5  # one dead letter per bad message
    reasons = sorted(r for r, _, _ in stored)
    assert any("bad magic" in r for r in reasons)
    assert any("truncated" in r for r in reasons)
    assert any("message key 'acme/not-this-node' disagrees" in r for r in reasons)
    assert "host column 'sample_frac' must be float64, got str" in reasons
    features = stack.wait_for(lambda: node_features(stack, pipeline_cfg.host), 30, "features after bad input")
    assert features[0][2]["cpu_busy_frac"] == pytest.approx(0.4)
    stack.check()  # the worker and the sink are still running
    # the dead letters are on the DLQ topic too, with the reason in a header
    consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "dlq-check", "fetch.wait.max.ms": 10})
    consumer.assign([TopicPartition(pipeline_cfg.topic("dlq"), p, 0) for p in range(pipeline_cfg.partitions)])
    got = []
    deadline = time.monotonic() + 10
    while len(got) < 5 and time.monotonic() < deadline:
        got += [m for m in consumer.consume(10, 0.5) if not m.error()]
    consumer.close()
    assert sorted(dict(m.headers())["fs-dlq-reason"].decode() for m in got) == reasons


def assert_every_window_once(stack, host, at_least: int):
    per_window = stack.query(
        "SELECT toUnixTimestamp64Milli(window_start) AS w, count() FROM features "
        "WHERE job = {h:String} GROUP BY w ORDER BY w", {"h": host}).rows
    counts = [c for _, c in per_window]
    assert counts == [1] * len(counts), f"duplicated windows: {per_window}"
    starts = [w for w, _ in per_window]
    assert starts == list(range(starts[0], starts[-1] + 1000, 1000)), "a window is missing"
    assert len(starts) >= at_least


def test_killed_worker_restarts_without_losing_or_duplicating_feature_rows(pipeline_cfg, embedded_stack, broker):
    host = pipeline_cfg.host
    stack = embedded_stack()
    agent, thread = run_agent(pipeline_cfg, broker.bootstrap, seconds=14.0)
    stack.wait_for(lambda: len(node_features(stack, host)) >= 3, 40, "first feature rows")
    stack.kill_worker(0)  # SIGKILL mid-run: no flush, no commit, no goodbye
    stack.restart_worker(0)
    thread.join()
    sent = agent.publisher.stats.events_sent
    wait_settled(stack, host, sent, 90, "the restarted worker and the sink to catch up")
    assert raw_rows(stack, host) == sent
    assert_every_window_once(stack, host, at_least=12)
    s = stack.worker_stats()  # the restarted worker's own counters
    assert s["replayed_events"] > 0 or s["events_in"] < sent  # it really resumed


def test_killed_sink_restarts_without_losing_or_duplicating_rows(pipeline_cfg, embedded_stack, broker):
    host = pipeline_cfg.host
    stack = embedded_stack()
    agent, thread = run_agent(pipeline_cfg, broker.bootstrap, seconds=14.0)
    stack.wait_for(lambda: len(node_features(stack, host)) >= 3, 40, "first feature rows")
    stack.kill_sink()  # SIGKILL mid-run: whatever it consumed but had not committed is replayed
    # the worker keeps computing and publishing while no sink runs
    windows_before, sent_before = stack.worker_stats()["windows_out"], agent.publisher.stats.events_sent
    stack.wait_for(lambda: stack.worker_stats()["windows_out"] > windows_before + 2
                   and agent.publisher.stats.events_sent > sent_before, 30, "the worker to go on without a sink")
    stack.restart_sink()
    thread.join()
    sent = agent.publisher.stats.events_sent
    wait_settled(stack, host, sent, 90, "the restarted sink to catch up")
    assert raw_rows(stack, host) == sent
    assert stack.query("SELECT count() FROM dlq").rows[0][0] == 0
    # Without FINAL: a poll stored but not committed before the kill is replayed as the same inserts with the
    # same dedupe tokens (the sink's poll plan), so the store drops the copy instead of keeping it until a merge.
    assert_every_window_once(stack, host, at_least=12)
    assert stack.query("SELECT count() FROM scores WHERE job = {h:String}", {"h": host}).rows[0][0] == \
        stack.query("SELECT count() FROM features WHERE job = {h:String}", {"h": host}).rows[0][0]
