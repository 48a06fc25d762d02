"""Two stream workers share the raw partitions beside one sink, on the real embedded broker and chDB
(the launcher's stack): a known number of events in, exactly those rows out, every window once."""
from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np
from confluent_kafka import Producer

from fleetscope.schema import node_identity
from fleetscope.topic_reader import read_topic
from fleetscope.wire import Batch, StrColumn, decode, encode
from fleetscope.streams.stats_file import read_worker_stats

NAMES = tuple(f"cpu.{s}" for s in ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"))


def host_batch(host: str, ts_ns: int) -> Batch:
    n = len(NAMES)
    cols = {"ts_ns": np.full(n, ts_ns, dtype="<i8"), **node_identity(host, n),
            "metric": StrColumn(np.arange(n, dtype=np.uint32), NAMES), "device": StrColumn.constant("all", n),
            "value": np.array([0.3, 0, 0.1, 0.6, 0, 0, 0, 0]), "interval_ns": np.full(n, 500_000_000, dtype="<i8")}
    return Batch("host", host, cols)


def features_on_topic(bootstrap: str, topic: str, partitions: int, hosts: set[str]) -> Counter:
    """(host, window_start_ns) -> how many times the workers published that window."""
    seen = Counter()
    for m in read_topic(bootstrap, topic, partitions):
        b = decode(m.value(), m.headers())
        jobs = [b.columns["job"].values[c] for c in b.columns["job"].codes.tolist()]
        for job, w in zip(jobs, b.columns["window_start_ns"].tolist()):
            if job in hosts:
                seen[(job, w)] += 1
    return seen


def wait_until_settled(stack, host_prefix: str, sent: int) -> None:
    """Until every worker has committed and closed its windows and the sink has stored every sent event."""
    def settled():
        w = stack.worker_stats()
        stored = stack.query("SELECT count() FROM raw_metrics WHERE startsWith(host, {p:String})",
                             {"p": host_prefix}).rows[0][0]
        return (stack.worker_lag() == 0 and w and w["open_windows"] == 0 and w["unacked_messages"] == 0
                and stored >= sent and stack.sink_lag() == 0)
    stack.wait_for(settled, 120, f"{sent} events stored and every window closed")

def test_two_workers_and_one_sink_store_every_event_and_each_window_once(pipeline_cfg, embedded_stack, broker):
    stack = embedded_stack(workers=2)
    hosts = [f"{pipeline_cfg.host}-{k}" for k in range(6)]
    producer = Producer({"bootstrap.servers": broker.bootstrap, "acks": "all", "enable.idempotence": True})
    topic = pipeline_cfg.raw_topic("host")
    t0 = time.time_ns() // 1_000_000_000 * 1_000_000_000 - 2_000_000_000
    sent, rounds, windows = 0, 0, {h: set() for h in hosts}

    def both_working() -> bool:
        docs = [read_worker_stats(stack.data_dir, w.pid) for w in stack.workers]
        return all(d and d["events_in"] > 0 for d in docs)

    # Event time advances 0.5 s a round; keep feeding (a known count) until both workers have taken a share
    # of the partitions and processed events from it, and for at least 16 rounds.
    deadline = time.monotonic() + 120
    while (rounds < 16 or not both_working()) and time.monotonic() < deadline:
        ts = t0 + rounds * 500_000_000
        for k, host in enumerate(hosts):
            b = host_batch(host, ts)
            producer.produce(topic, key=f"_node/{host}".encode(), value=encode(b), headers=b.kafka_headers(),
                             partition=k % pipeline_cfg.partitions)
            sent += b.count
            windows[host].add(ts // 1_000_000_000 * 1_000_000_000)
        assert producer.flush(10) == 0
        rounds += 1
        time.sleep(0.5)  # the data's pace, not a synchronisation
    assert both_working(), "the second worker never got a share of the partitions"

    wait_until_settled(stack, pipeline_cfg.host, sent)

    assert stack.query("SELECT count() FROM raw_metrics WHERE startsWith(host, {p:String})",
                       {"p": pipeline_cfg.host}).rows[0][0] == sent
    assert stack.query("SELECT count() FROM dlq").rows[0][0] == 0
    stored = Counter({(h, w): n for h, w, n in stack.query(
        "SELECT job, toUnixTimestamp64Nano(window_start), count() FROM features WHERE tenant = '_node' "
        "AND startsWith(job, {p:String}) GROUP BY job, window_start", {"p": pipeline_cfg.host}).rows})
    expected = {(h, w) for h in hosts for w in windows[h]}
    assert set(stored) == expected, f"missing {sorted(expected - set(stored))[:5]}, extra {sorted(set(stored) - expected)[:5]}"
    assert [k for k, n in stored.items() if n != 1] == [], "a window stored twice"
    published = features_on_topic(broker.bootstrap, pipeline_cfg.topic("features"), pipeline_cfg.partitions, set(hosts))
    assert set(published) == expected
    assert [k for k, n in published.items() if n != 1] == [], "a window published by both workers"


def test_a_worker_joining_and_leaving_mid_window_hands_every_window_over_whole(pipeline_cfg, embedded_stack, broker):
    """A second worker joins, then leaves, while traffic goes on: each handover happens with windows open
    (event time advances 0.25 s a send, so every 1 s window straddles each rebalance). A revoked worker must
    not emit its open windows (partial) nor hold marks the new owner trusts; every event stored lands in
    exactly one window, published once."""
    stack = embedded_stack(workers=1)
    hosts = [f"{pipeline_cfg.host}-{k}" for k in range(6)]
    producer = Producer({"bootstrap.servers": broker.bootstrap, "acks": "all", "enable.idempotence": True})
    topic = pipeline_cfg.raw_topic("host")
    t0 = time.time_ns() // 1_000_000_000 * 1_000_000_000 - 2_000_000_000
    state = {"sent": 0, "sends": 0, "stop": False}
    windows = {h: set() for h in hosts}

    def send_one() -> None:
        ts = t0 + state["sends"] * 250_000_000
        for k, host in enumerate(hosts):
            b = host_batch(host, ts)
            producer.produce(topic, key=f"_node/{host}".encode(), value=encode(b), headers=b.kafka_headers(),
                             partition=k % pipeline_cfg.partitions)
            state["sent"] += b.count
            windows[host].add(ts // 1_000_000_000 * 1_000_000_000)
        assert producer.flush(10) == 0
        state["sends"] += 1

    def feed() -> None:  # the traffic goes on while workers start and stop, as in a real scale-out
        while not state["stop"]:
            send_one()
            time.sleep(0.25)  # the data's pace, not a synchronisation

    def both_working() -> bool:
        docs = [read_worker_stats(stack.data_dir, w.pid) for w in stack.workers if w.alive()]
        return len(docs) == 2 and all(d and d["events_in"] > 0 for d in docs)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        stack.wait_for(lambda: (stack.worker_stats() or {}).get("events_in", 0) > 0, 60, "the first worker working")
        i = stack.add_worker()
        stack.wait_for(both_working, 120, "both workers working")
        first = state["sends"]
        stack.wait_for(lambda: state["sends"] >= first + 8, 60, "traffic while both work")
        stack.retire_worker(i)
        last = state["sends"]
        stack.wait_for(lambda: state["sends"] >= last + 8, 60, "traffic after the second worker left")
    finally:
        state["stop"] = True
        feeder.join(30)
    sent = state["sent"]

    wait_until_settled(stack, pipeline_cfg.host, sent)

    assert stack.query("SELECT count() FROM raw_metrics WHERE startsWith(host, {p:String})",
                       {"p": pipeline_cfg.host}).rows[0][0] == sent
    assert stack.query("SELECT count() FROM dlq").rows[0][0] == 0
    in_windows = stack.query("SELECT sum(event_count) FROM features FINAL WHERE tenant = '_node' "
                             "AND startsWith(job, {p:String})", {"p": pipeline_cfg.host}).rows[0][0]
    assert in_windows == sent, f"{sent - in_windows} of {sent} stored events are in no window"
    expected = {(h, w) for h in hosts for w in windows[h]}
    published = features_on_topic(broker.bootstrap, pipeline_cfg.topic("features"), pipeline_cfg.partitions, set(hosts))
    assert set(published) == expected, f"missing {sorted(expected - set(published))[:5]}"
    assert [k for k, n in published.items() if n != 1] == [], "a window published by both workers"
