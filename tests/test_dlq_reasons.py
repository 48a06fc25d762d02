"""Dead-letter reasons map to a fixed set of /metrics categories. Every reason here is made by the code that
writes it in production (the decoder, schema.validate, the admission checks, the sink's TopicWriter on a real
chDB store, store_writes.Insert), not typed by hand, so a reworded message that falls out of its category
fails here rather than turning into `other` on a dashboard."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from fleetscope.config import Config
from fleetscope.schema import validate
from fleetscope.wire import Batch, StrColumn, WireError, decode, encode
from fleetscope.streams.admission import AdmissionError, TimeBounds, check_key, check_string
from fleetscope.streams.dlq_reasons import CATEGORIES, dlq_category
from fleetscope.streams.sink.tables import Record
from fleetscope.streams.sink.writer import TopicWriter
from fleetscope.streams.store_writes import REJECT_AFTER, Insert, StoreUnavailable
from support.wire_messages import metric_batch


def reason_of(call) -> str:
    with pytest.raises((WireError, AdmissionError)) as info:
        call()
    return str(info.value)


def rank_batch(tenant="acme", job="train", ts_ns=None) -> Batch:
    n = 2
    ts = np.full(n, ts_ns if ts_ns is not None else time.time_ns(), dtype="<i8")
    return Batch("host", "node-a", {
        "ts_ns": ts, "tenant": StrColumn.constant(tenant, n), "job": StrColumn.constant(job, n),
        "rank": np.zeros(n, dtype="<i4"), "pid": np.ones(n, dtype="<i4"), "gpu": np.zeros(n, dtype="<i2"),
        "metric": StrColumn.constant("cpu.user", n), "device": StrColumn.constant("all", n),
        "value": np.ones(n), "interval_ns": np.full(n, 10**9, dtype="<i8")})


def test_the_workers_reasons_fall_in_their_categories():
    good = encode(metric_batch())
    bounds = TimeBounds(ttl_days=7, max_future_skew_s=300)
    cases = {
        "decode": [reason_of(lambda: decode(b"not arrow at all")), reason_of(lambda: decode(good[: len(good) // 2])),
                   reason_of(lambda: decode(b"")), reason_of(lambda: decode(good, [("fs-source", b"gpu")]))],
        "schema": [reason_of(lambda: validate(metric_batch(source="no-such-source"))),
                   reason_of(lambda: validate(Batch("host", "n", {"ts_ns": np.ones(2, dtype="<i8")}))),
                   reason_of(lambda: check_string("tenant", "a\x01b")),
                   reason_of(lambda: check_string("column 'metric' value", "x" * 10_000))],
        "timestamp": [reason_of(lambda: bounds.check(np.array([time.time_ns() + 3600 * 10**9]))),
                      reason_of(lambda: bounds.check(np.array([time.time_ns() - 30 * 86400 * 10**9])))],
        "key_mismatch": [reason_of(lambda: check_key(b"acme/other", rank_batch())),
                         reason_of(lambda: check_key(None, rank_batch())),
                         reason_of(lambda: check_key(b"\xff\xfe", rank_batch()))],
        # processor.py's own prefixes around an exception that escaped its step
        "handler_error": ["windowing failed: KeyError: 'ts_ns'"],
    }
    cases["decode"].append("decoding failed: IndexError: list index out of range")
    for category, reasons in cases.items():
        for reason in reasons:
            assert dlq_category(reason) == category, reason
    assert dlq_category("a reason nobody wrote yet") == "other"
    assert dlq_category(b"event time 2099-01-01T00:00:00Z is 1 s ahead") == "timestamp"  # a header's bytes


def test_the_sinks_reasons_fall_in_their_categories(store):
    cfg = Config(topic_prefix="reasons", data_dir=None)
    writer = TopicWriter(cfg, store)
    anomaly = {"tenant": "a", "job": "j", "host": "h", "rank": 0, "window_start_ns": time.time_ns(),
               "score": 1.0, "threshold": 2.0}
    records = [
        Record(cfg.topic("anomalies"), 0, 0, 0, b"a/j", b"{not json", [("fs-schema", b"anomaly/1")]),
        Record(cfg.topic("anomalies"), 0, 1, 0, b"a/j", json.dumps(anomaly).encode(), [("fs-schema", b"anomaly/0")]),
        Record(cfg.topic("anomalies"), 0, 2, 0, b"a/j", b"[1, 2]", [("fs-schema", b"anomaly/1")]),
        Record(cfg.topic("features"), 0, 3, 0, b"a/j", encode(metric_batch()), []),
        Record(cfg.topic("features"), 0, 4, 0, b"a/j", b"garbage", []),
        Record(cfg.topic("model-state"), 0, 5, 0, b"a/j", b'{"schema": "nope"}', []),
    ]
    writer.inserts(records)
    got = [dlq_category(why) for _, why in writer.dead]
    assert got == ["decode", "schema", "schema", "schema", "decode", "decode"], [why for _, why in writer.dead]

    # the store's refusal, as store_writes.Insert words it after REJECT_AFTER tries (a part whose rows
    # cannot be built counts as refused data: the store answers, so it is not an outage)
    refused = []
    insert = Insert("anomalies", [anomaly], lambda parts: {"tenant": [p["missing"] for p in parts]},
                    lambda parts: "tok", lambda part, why: refused.append(why))
    for _ in range(REJECT_AFTER - 1):
        with pytest.raises(StoreUnavailable):
            insert.run(store)
    insert.run(store)
    assert len(refused) == 1 and dlq_category(refused[0]) == "store_refused", refused


def test_categories_are_a_fixed_small_set():
    assert len(CATEGORIES) == len(set(CATEGORIES)) == 7 and "other" in CATEGORIES
