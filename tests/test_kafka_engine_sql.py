"""The ClickHouse Kafka-engine SQL for raw topics (sql/kafka_engine/raw_metrics.sql), checked offline.

What runs for real: the renderer and its refusals; chDB parsing both statements (formatQuery); the Arrow
schema of messages built by the project's encoder, read by chDB's ArrowStream reader; the materialized view,
created as rendered, writing the real migrated raw_metrics; the sink's own RawSink, for comparison.

The stand-in: chDB cannot create a Kafka table at all (chDB 4.4.0: `CREATE TABLE ... ENGINE = Kafka` fails
with "Shutdown was called", whatever the broker), and there is no ClickHouse server here. So the queue
table is replaced by a Memory table with the same columns plus the engine's virtual columns (_topic, _key,
_offset, _partition, _headers.name/value, _raw_message, _error) as ordinary ones, and each message goes in
as the engine would put it: the encoded bytes read with `file(..., 'ArrowStream', <the queue's columns>)`,
the topic, key, offset and Kafka headers beside them. A message that does not parse is inserted as the
engine's 'stream' error mode makes it: one row of NULLs with _error set. Neither the real engine's
consumption nor its offset commits are exercised here.
"""
from __future__ import annotations

import re
import time

import numpy as np
import pyarrow as pa
import pytest

from fleetscope.batch import SCHEMA_VERSION
from fleetscope.config import Config
from fleetscope.schema import OPTIONAL_COLUMNS, PLACEMENT_COLUMNS, SOURCE_COLUMNS, STR
from fleetscope.store.base import StoreError
from fleetscope.store.kafka_engine import KafkaEngineParams, render, statements
from fleetscope.streams.sinks import RawSink
from fleetscope.topics import RAW_SOURCES
from fleetscope.wire import Batch, StrColumn, decode, encode

VIRTUAL = ("_topic LowCardinality(String), _key String, _offset UInt64, _partition UInt64, "
           "`_headers.name` Array(String), `_headers.value` Array(String), _raw_message String, _error String")
PREFIX = "kt"
PARAMS = KafkaEngineParams(brokers="127.0.0.1:9092", prefix=PREFIX)


def queue_columns(queue_sql: str) -> str:
    return re.search(r"raw_kafka_queue\s*\((.*)\)\s*ENGINE = Kafka", queue_sql, re.S).group(1)


def column_types(columns: str) -> dict[str, str]:
    return dict(line.strip().rstrip(",").split(None, 1) for line in columns.strip().splitlines())


def sql_literal(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def batch_for(source: str, n: int = 3, ts_ns: int | None = None, host: str = "node-a", placed: bool = False,
              tenant: str = "acme", job: str = "llm", every_optional: bool = False) -> Batch:
    """A batch with every column its source must carry, and the placement columns when `placed`, every
    optional column (sample_frac too) when `every_optional`."""
    ts = time.time_ns() - 60 * 10**9 if ts_ns is None else ts_ns
    spec = {**SOURCE_COLUMNS[source], **(PLACEMENT_COLUMNS if placed else {}),
            **(OPTIONAL_COLUMNS if every_optional else {})}
    cols = {}
    for name, kind in spec.items():
        if kind == STR:
            cols[name] = StrColumn.of([f"{name}-{i % 2}" for i in range(n)])
        else:
            cols[name] = (np.arange(n) + 1).astype(kind)
    cols.update(ts_ns=np.arange(n, dtype="<i8") + ts, tenant=StrColumn.constant(tenant, n),
                job=StrColumn.constant(job, n), value=np.linspace(0.5, 2.5, n))
    if "sample_frac" in cols:
        cols["sample_frac"] = np.full(n, 0.25)
    return Batch(source, host, cols)


# ---- rendering ---------------------------------------------------------------------------------------------

def test_rendering_fills_every_placeholder_with_the_configured_topics_and_group():
    sql = render(KafkaEngineParams(brokers="kafka-0:9092, kafka-1:9093", prefix="prod", database="fs",
                                   num_consumers=4, ttl_days=30, max_future_skew_s=60))
    assert not re.findall(r"\{[a-z_]+\}", sql)
    cfg = Config(topic_prefix="prod")
    topics = re.search(r"kafka_topic_list = '([^']*)'", sql).group(1).split(",")
    assert topics == [cfg.raw_topic(s) for s in RAW_SOURCES]
    assert "kafka_broker_list = 'kafka-0:9092,kafka-1:9093'" in sql
    assert "kafka_group_name = 'prod-clickhouse-raw'" in sql and "kafka_num_consumers = 4" in sql
    assert "kafka_format = 'ArrowStream'" in sql and "kafka_handle_error_mode = 'stream'" in sql
    assert "fs.raw_kafka_queue" in sql and "TO fs.raw_metrics" in sql
    assert f"wire_version != '{SCHEMA_VERSION}'" in sql
    assert "now_ns + 60000000000" in sql and "now_ns - 30 * 86400000000000" in sql


@pytest.mark.parametrize("change", [
    {"brokers": "k:9092';DROP TABLE x"}, {"brokers": "k"}, {"brokers": ""}, {"prefix": "a b"}, {"prefix": "x'"},
    {"group": "g;1"}, {"database": "fs-1"}, {"num_consumers": 0}, {"num_consumers": True}, {"ttl_days": 0},
    {"max_future_skew_s": -1},
])
def test_rendering_refuses_a_value_that_could_break_out_of_the_sql(change):
    with pytest.raises(StoreError):
        render(KafkaEngineParams(**{"brokers": "k:9092", **change}))


def test_the_cli_prints_the_rendered_sql(capsys, tmp_path):
    from fleetscope.cli.main import main
    (tmp_path / "none.toml").write_text("")
    assert main(["db", "kafka-engine-sql", "--brokers", "ch-kafka:9092", "--prefix", "demo",
                 "--group", "ch-raw", "--consumers", "2", "--config", str(tmp_path / "none.toml")]) == 0
    out = capsys.readouterr().out
    assert "kafka_broker_list = 'ch-kafka:9092'" in out and "kafka_group_name = 'ch-raw'" in out
    assert "demo.raw.nvml" in out and "kafka_num_consumers = 2" in out


def test_sink_no_raw_leaves_exactly_the_raw_topics_to_the_engine():
    """`fleetscope sink --no-raw` beside the engine: the sink's subscription is its usual one less the raw
    topics the engine reads, so no raw row is stored by both."""
    from fleetscope.cli.main import build_parser
    from fleetscope.streams.sink.consumer import sink_topics
    from fleetscope.streams.sink.service import subscribed_topics
    cfg = Config(topic_prefix=PREFIX)
    assert build_parser().parse_args(["sink", "--no-raw"]).no_raw is True
    assert build_parser().parse_args(["sink"]).no_raw is False
    engine_topics = set(PARAMS.raw_topics())
    assert subscribed_topics(cfg, raw=True) == sink_topics(cfg)
    without = subscribed_topics(cfg, raw=False)
    assert set(without) == set(sink_topics(cfg)) - engine_topics
    assert engine_topics <= set(sink_topics(cfg)) and cfg.topic("dlq") in without


# ---- what chDB can check -----------------------------------------------------------------------------------

def test_chdb_parses_both_statements():
    import chdb
    queue, view = statements(PARAMS)
    for stmt in (queue, view):
        formatted = str(chdb.query(f"SELECT formatQuery({sql_literal(stmt)})", "TSVRaw"))
        assert formatted.strip()
    assert queue.startswith("CREATE TABLE IF NOT EXISTS fleetscope.raw_kafka_queue")
    assert view.startswith("CREATE MATERIALIZED VIEW IF NOT EXISTS fleetscope.raw_kafka_to_raw_metrics")


def test_the_queue_reads_every_column_producers_send_with_the_type_chdb_reads_it_as(tmp_path):
    """Every source's batch, with the optional columns too, encoded by the project's encoder: its Arrow
    columns are the queue's columns, and ClickHouse's ArrowStream reader infers the queue's types (less
    Nullable, which the queue adds so that an absent column reads as NULL)."""
    import chdb
    queue_types = column_types(queue_columns(statements(PARAMS)[0]))
    sent: dict[str, str] = {}
    for source in SOURCE_COLUMNS:
        message = encode(batch_for(source, every_optional=True))
        arrow_names = pa.ipc.open_stream(message).schema.names
        assert set(arrow_names) <= set(queue_types), f"{source} sends columns the queue does not read"
        path = tmp_path / f"{source}.arrows"
        path.write_bytes(message)
        for name, ch_type, *_ in [line.split("\t") for line in str(chdb.query(
                f"DESCRIBE file({sql_literal(str(path))}, 'ArrowStream')", "TSV")).strip().splitlines()]:
            sent[name] = ch_type
    assert set(sent) == set(queue_types)
    for name, ch_type in sent.items():
        assert queue_types[name].replace("Nullable(", "").replace(")", "") == ch_type.replace(")", ""), name


def test_the_view_selects_exactly_the_raw_metrics_columns_but_ingested_at(store):
    view = statements(PARAMS)[1]
    selected = re.search(r"AS SELECT (.*?)\nFROM\n", view, re.S).group(1)
    out_names = [item.split(" AS ")[-1].strip() for item in selected.split(",")]
    table = [r[0] for r in store.query("SELECT name FROM system.columns WHERE database = 'fleetscope' AND "
                                       "table = 'raw_metrics' ORDER BY position").rows]
    assert sorted(out_names) == sorted(c for c in table if c != "ingested_at")


# ---- the view against the real raw_metrics, through a stand-in queue ---------------------------------------

class StandInQueue:
    """The queue table as a Memory table (see the module docstring) with the rendered view on it."""

    def __init__(self, store, tmp_path):
        self.store, self.tmp_path, self.offset = store, tmp_path, 0
        queue, self.view = statements(PARAMS)
        self.columns = queue_columns(queue)
        self.names = list(column_types(self.columns))
        store.query(f"CREATE TABLE fleetscope.raw_kafka_queue ({self.columns}, {VIRTUAL}) ENGINE = Memory")
        store.query(self.view)

    def send(self, batch_or_bytes, key: str | None = None, headers: list | None = None, topic: str | None = None):
        """One message, as the engine would read it; returns its offset."""
        self.offset += 1
        batch = batch_or_bytes if isinstance(batch_or_bytes, Batch) else None
        headers = batch.kafka_headers() if headers is None else headers
        path = self.tmp_path / f"m{self.offset}.arrows"
        path.write_bytes(encode(batch) if batch else batch_or_bytes)
        self.store.query(
            f"INSERT INTO fleetscope.raw_kafka_queue ({', '.join(self.names)}, _topic, _key, _offset, _partition, "
            "`_headers.name`, `_headers.value`, _raw_message, _error) "
            "SELECT *, {topic:String}, {key:String}, {offset:UInt64}, 0, splitByChar(char(31), {hn:String}), "
            "splitByChar(char(31), {hv:String}), '', '' FROM file({path:String}, 'ArrowStream', {structure:String})",
            {"topic": topic or f"{PREFIX}.raw.{batch.source}",
             "key": key if key is not None else f"{decoded_one(batch, 'tenant')}/{decoded_one(batch, 'job')}",
             "offset": self.offset, "hn": "\x1f".join(k for k, _ in headers),
             "hv": "\x1f".join(v.decode() for _, v in headers), "path": str(path), "structure": " ".join(self.columns.split())})
        return self.offset

    def send_unreadable(self, error: str, topic: str) -> int:
        """What kafka_handle_error_mode='stream' makes of a message that does not parse: one row, _error set."""
        self.offset += 1
        self.store.query("INSERT INTO fleetscope.raw_kafka_queue (_topic, _key, _offset, _partition, _raw_message, "
                         "_error) VALUES ({topic:String}, '', {offset:UInt64}, 0, 'junk', {error:String})",
                         {"topic": topic, "offset": self.offset, "error": error})
        return self.offset

    def rejects(self) -> dict[int, str]:
        """Each message's verdict, from the view's own query ('' = stored)."""
        inner = self.view[self.view.index("\nFROM\n(") + len("\nFROM"):self.view.rindex("WHERE message_reject")]
        rows = self.store.query(f"SELECT msg_offset, any(message_reject) FROM {inner} GROUP BY msg_offset").rows
        return {int(o): r for o, r in rows}


def decoded_one(batch: Batch, name: str) -> str:
    col = batch.columns[name]
    return col.values[int(col.codes[0])]


ROW_SQL = ("SELECT source, tenant, job, host, rank, pid, gpu, pod, namespace, container, toUnixTimestamp64Nano(ts), "
           "metric, device, value, interval_ns, sample_frac, batch_id FROM fleetscope.raw_metrics "
           "ORDER BY batch_id, ts, metric, device")


def test_the_view_stores_the_same_rows_as_the_sink(store, tmp_path):
    """A node batch (no sample_frac, no placement), a traced batch (sample_frac), a placed process batch:
    the sink's RawSink and the view, from the same messages, store the same raw_metrics rows."""
    batches = [batch_for("host", host="node-a", tenant="_node", job="node-a"), batch_for("cuda", n=5),
               batch_for("proc", n=4, placed=True)]
    messages = [encode(b) for b in batches]
    assert RawSink(store).write([decode(m) for m in messages]) == []
    by_sink = store.query(ROW_SQL).rows
    assert len(by_sink) == 12
    store.query("TRUNCATE TABLE fleetscope.raw_metrics")

    queue = StandInQueue(store, tmp_path)
    for b in batches:
        queue.send(b)
    assert store.query(ROW_SQL).rows == by_sink
    stored = {r[0]: r[1] for r in store.query("SELECT source, any(sample_frac) FROM fleetscope.raw_metrics "
                                              "GROUP BY source").rows}
    assert stored == {"host": 1.0, "cuda": 0.25, "proc": 1.0}
    assert store.query("SELECT count() FROM fleetscope.raw_metrics WHERE pod != ''").rows[0][0] == 4


def test_the_view_drops_each_message_it_rejects_whole_and_stores_the_rest(store, tmp_path):
    queue = StandInQueue(store, tmp_path)
    good = queue.send(batch_for("nvml", n=3))
    cases = {
        queue.send(batch_for("host"), key="acme/other"): "the Kafka key is not the rows' tenant/job",
        queue.send(_with_metric(batch_for("host", n=3), 1, "bad\x07name")):
            "a string is not valid UTF-8, too long, or holds a control character",
        queue.send(_without(batch_for("cuda"), "sample_frac")): "a traced source lacks sample_frac",
        queue.send(_without(batch_for("host"), "device")): "a required column is missing",
        queue.send(batch_for("host", ts_ns=time.time_ns() + 3600 * 10**9)): "event time too far ahead of the server clock",
        queue.send(batch_for("host", ts_ns=time.time_ns() - 30 * 86_400 * 10**9)): "event time older than the retention",
        queue.send(batch_for("host", tenant="")): "an identity string is empty",
    }
    b = batch_for("host")
    headers = [(k, b"1" if k == "fs-schema" else v) for k, v in b.kafka_headers()]
    cases[queue.send(b, headers=headers)] = f"fs-schema header is not {SCHEMA_VERSION}"
    b = batch_for("host")
    cases[queue.send(b, headers=[(k, v) for k, v in b.kafka_headers() if k != "fs-batch"])] = "an identity string is empty"
    b = batch_for("host")
    cases[queue.send(b, headers=[(k, b"gpu" if k == "fs-source" else v) for k, v in b.kafka_headers()])] = "unknown source"
    cases[queue.send_unreadable("Cannot read the Arrow stream", f"{PREFIX}.raw.host")] = \
        "unreadable: Cannot read the Arrow stream"

    verdicts = queue.rejects()
    assert {o: verdicts[o] for o in cases} == cases
    assert verdicts[good] == ""
    assert store.query("SELECT source, count() FROM fleetscope.raw_metrics GROUP BY source").rows == [("nvml", 3)]


def _with_metric(batch: Batch, row: int, value: str) -> Batch:
    names = [decoded_one(batch, "metric")] * batch.count
    names[row] = value
    return Batch(batch.source, batch.host, {**batch.columns, "metric": StrColumn.of(names)}, batch_id=batch.batch_id)


def _without(batch: Batch, name: str) -> Batch:
    return Batch(batch.source, batch.host, {k: v for k, v in batch.columns.items() if k != name},
                 batch_id=batch.batch_id)
