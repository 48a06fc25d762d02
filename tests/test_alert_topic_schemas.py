"""The alert topics' JSON against the JSON Schemas shipped in fleetscope/schemas/.

The messages are the worker's own: raw batches of a straggling NCCL job (tests/support/straggler_job.py;
no GPU here, so its cuda/nccl rows are written, not traced) go through StreamProcessor.handle/flush, which
publishes with a real producer to the embedded broker; a consumer reads <p>.anomalies and <p>.diagnoses
back. Each message must validate against the schema its `fs-schema` header names. The schemas require
every field and allow no other, so a field renamed or dropped in the producer fails here.
"""
from __future__ import annotations

import json
import uuid
from importlib.resources import files

import jsonschema
import pytest
from confluent_kafka import Producer

from fleetscope.config import Config
from fleetscope.topic_reader import read_topic
from fleetscope.topics import all_topics, ensure_topics
from fleetscope.streams.derived_codec import ANOMALY_SCHEMA, DIAGNOSIS_SCHEMA, SCHEMA_FILES
from fleetscope.streams.processor import StreamProcessor
from support.straggler_job import StoppedClock, StragglerJob, feed, recent_start_ns

WARMUP, ONSET, WINDOWS = 8, 14, 24
HEADER_OF_TOPIC = {"anomalies": ANOMALY_SCHEMA, "diagnoses": DIAGNOSIS_SCHEMA}


def schema_named(header: str) -> dict:
    return json.loads(files("fleetscope.schemas").joinpath(SCHEMA_FILES[header]).read_text())


def validator(header: str) -> jsonschema.Draft202012Validator:
    schema = schema_named(header)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def published_alerts(store, tmp_path, bootstrap: str) -> dict[str, list[tuple[dict, bytes]]]:
    prefix = f"s{uuid.uuid4().hex[:8]}"
    cfg = Config(data_dir=tmp_path, topic_prefix=prefix, partitions=1, window_s=1.0, allowed_lateness_s=0.5,
                 idle_close_s=30, warmup_windows=WARMUP, model_checkpoint_s=0)
    ensure_topics(bootstrap, all_topics(cfg), 1)
    proc = StreamProcessor(cfg, store, producer=Producer({"bootstrap.servers": bootstrap}), clock=StoppedClock())
    feed(proc, StragglerJob(recent_start_ns(), ONSET), WINDOWS, prefix)
    assert proc.snapshot()["model_diagnoses"] > 0, proc.snapshot()

    got: dict[str, list[tuple[dict, bytes]]] = {t: [] for t in HEADER_OF_TOPIC}
    for t in HEADER_OF_TOPIC:
        got[t] = [(dict(m.headers() or ()), m.value()) for m in read_topic(bootstrap, cfg.topic(t), partitions=1)]
    return got


@pytest.fixture(scope="module")
def alerts(tmp_path_factory, broker):
    from fleetscope.store import open_store
    path = tmp_path_factory.mktemp("alert-schemas")
    store = open_store(path, clickhouse_url=None, prefer_endpoint=False)
    store.migrate()
    try:
        yield published_alerts(store, path, broker.bootstrap)
    finally:
        store.close()


@pytest.mark.parametrize("topic", sorted(HEADER_OF_TOPIC))
def test_every_published_alert_matches_the_schema_its_header_names(alerts, topic):
    messages = alerts[topic]
    assert messages, f"the straggler produced no <p>.{topic} messages"
    for headers, value in messages:
        header = headers["fs-schema"].decode()
        assert header == HEADER_OF_TOPIC[topic]
        assert schema_named(header)["$id"] == f"fleetscope/{header}"  # the header names this very schema
        errors = [e.message for e in validator(header).iter_errors(json.loads(value))]
        assert not errors, (topic, errors, value[:400])


def test_the_diagnoses_carry_the_straggler_match_so_nested_matches_are_validated(alerts):
    entries = {m["kb_entry"] for _, v in alerts["diagnoses"] for m in json.loads(v)["matches"]}
    assert "straggler_rank" in entries, entries
    assert any(json.loads(v)["top_features"] for _, v in alerts["diagnoses"])


@pytest.mark.parametrize("topic", sorted(HEADER_OF_TOPIC))
def test_a_renamed_or_dropped_field_fails_the_schema(alerts, topic):
    """The check above can fail: every field of a real message, renamed or dropped, is refused, at the top
    level and inside the nested objects (diagnosis matches and top features)."""
    header, value = HEADER_OF_TOPIC[topic], json.loads(alerts[topic][0][1])
    check = validator(header)
    for variant in mutations(value):
        assert not check.is_valid(variant), variant


def mutations(message: dict):
    for key in message:
        yield {k: v for k, v in message.items() if k != key}
        yield {(k + "_x" if k == key else k): v for k, v in message.items()}
    for field in ("matches", "top_features"):
        items = message.get(field) or []
        if items:
            for key in items[0]:
                for item in ({k: v for k, v in items[0].items() if k != key},
                             {(k + "_x" if k == key else k): v for k, v in items[0].items()}):
                    yield {**message, field: [item, *items[1:]]}
