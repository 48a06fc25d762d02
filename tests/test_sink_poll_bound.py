"""A sink's poll is bounded by rows as well as records (sink_max_rows_per_insert), so one insert
no longer grows with the producers' batch size; and a poll cut short that way is replayed exactly.
Real embedded broker, real consumer group, real chDB. The kill is simulated at the one point that
matters (after the inserts, before the commit), as in tests/test_delivery.py."""
import time
import uuid

import numpy as np
import pytest
from confluent_kafka import Producer

from fleetscope.config import Config, ConfigError
from fleetscope.schema import node_identity
from fleetscope.topics import all_topics, ensure_topics
from fleetscope.wire import Batch, StrColumn, encode
from fleetscope.streams.sink.consumer import Sink
from support.subscribed_sink import store_then_die_before_commit, subscribed_sink

SEC = 10**9
HOUR = 3600 * SEC
T0 = (time.time_ns() // HOUR - 2) * HOUR  # within retention and the future-skew bound
ROWS_PER_RECORD = 1000
RECORDS = 10


def raw_batch(host: str, k: int) -> Batch:
    n = ROWS_PER_RECORD
    cols = {"ts_ns": T0 + k * SEC + np.arange(n, dtype="<i8"), **node_identity(host, n),
            "metric": StrColumn(np.arange(n, dtype=np.uint32) % 2, ("cpu.user", "cpu.idle")),
            "device": StrColumn.constant("all", n), "value": np.linspace(0, 1, n),
            "interval_ns": np.full(n, SEC, dtype="<i8")}
    return Batch("host", host, cols)


@pytest.fixture
def setup(broker, store, tmp_path):
    run = uuid.uuid4().hex[:8]
    cfg = Config(data_dir=tmp_path, topic_prefix=f"t{run}", consumer_group=f"g{run}", partitions=2)
    ensure_topics(broker.bootstrap, all_topics(cfg), 2)
    host = f"host-{run}"
    producer = Producer({"bootstrap.servers": broker.bootstrap, "acks": "all"})
    for k in range(RECORDS):
        batch = raw_batch(host, k)
        producer.produce(cfg.raw_topic("host"), key=f"_node/{host}".encode(), value=encode(batch),
                         headers=batch.kafka_headers(), partition=k % 2)
    assert producer.flush(10) == 0

    def sink(max_rows):
        return subscribed_sink(cfg, store, broker.bootstrap, max_rows=max_rows)

    def stored():
        return store.query("SELECT count() FROM raw_metrics WHERE host = {h:String}", {"h": host}).rows[0][0]

    return sink, stored


def test_a_poll_holds_at_most_the_configured_rows_and_everything_is_stored_once(setup):
    sink, stored = setup
    s = sink(max_rows=2500)
    polls, deadline = [], time.monotonic() + 60
    while stored() < RECORDS * ROWS_PER_RECORD and time.monotonic() < deadline:
        before = s.writer.stats.raw_rows
        s.step(0.5)
        if s.writer.stats.raw_rows > before:
            polls.append(s.writer.stats.raw_rows - before)
    s.consumer.close()
    assert stored() == RECORDS * ROWS_PER_RECORD
    assert sum(polls) == RECORDS * ROWS_PER_RECORD
    assert max(polls) <= 2500, polls  # without the bound one poll took all 10,000 rows


def test_a_single_record_over_the_bound_is_stored_alone():
    from fleetscope.streams.sink.consumer import record_rows
    from fleetscope.streams.sink.tables import Record
    batch = raw_batch("node-a", 0)
    rec = Record("t.raw.host", 0, 0, 0, b"_node/node-a", encode(batch), batch.kafka_headers())
    assert record_rows(rec) == ROWS_PER_RECORD
    s = Sink.__new__(Sink)
    s.max_rows, s._carry = 10, []
    assert s._bounded([rec]) == [rec] and s._carry == []


def test_a_poll_cut_by_rows_is_replayed_exactly_after_a_kill_whatever_the_new_bound(setup):
    sink, stored = setup
    first = sink(max_rows=2500)
    store_then_die_before_commit(first)
    before_kill = stored()
    assert 0 < before_kill <= 2500
    second = sink(max_rows=1_000_000)  # a larger bound would regroup the poll, were it not replayed as planned
    deadline = time.monotonic() + 60
    while stored() < RECORDS * ROWS_PER_RECORD and time.monotonic() < deadline:
        second.step(0.5)
    for _ in range(5):  # anything the replay would still add
        second.step(0.2)
    second.consumer.close()
    assert second.replayed_polls == 1
    assert stored() == RECORDS * ROWS_PER_RECORD  # the replayed poll's rows were dropped as copies


def test_the_bound_must_be_positive():
    with pytest.raises(ConfigError, match="sink_max_rows_per_insert=0"):
        Config(sink_max_rows_per_insert=0).validate()
