"""The SQL of ClickHouse's Kafka engine for raw topics (sql/kafka_engine/), with its placeholders filled.

The alternative to `fleetscope sink` for raw topics on a ClickHouse server: the server consumes the raw
topics itself (`kafka_format = 'ArrowStream'`) and a materialized view writes raw_metrics. What it does and
does not check is in the SQL file's header; `fleetscope db kafka-engine-sql` prints the rendered SQL.

Every value goes into a SQL string literal or a number, so each is checked against a narrow pattern
first (no quotes, spaces or semicolons can reach the SQL). Plain replacement, as in the migrations:
the SQL has braces of its own (`\\x{9f}` in a regular expression).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from fleetscope.batch import SCHEMA_VERSION
from fleetscope.resources import package_dir
from fleetscope.schema import SOURCE_COLUMNS, TRACED_SOURCES
from fleetscope.store.base import StoreError, check_identifier
from fleetscope.store.migrations import split_statements

FILE = "raw_metrics.sql"
_HOST_PORT = r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}"
_BROKERS = re.compile(rf"{_HOST_PORT}(?:,{_HOST_PORT})*")
_KAFKA_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")  # Kafka's own rule for topic names (legal chars, length)
MAX_CONSUMERS = 256


@dataclass(frozen=True)
class KafkaEngineParams:
    brokers: str                # kafka_broker_list as the ClickHouse server reaches Kafka
    prefix: str = "fleetscope"  # the topic prefix
    database: str = "fleetscope"
    group: str = ""             # kafka_group_name; "" means "<prefix>-clickhouse-raw"
    num_consumers: int = 1
    ttl_days: int = 7
    max_future_skew_s: float = 300.0

    def consumer_group(self) -> str:
        return self.group or f"{self.prefix}-clickhouse-raw"

    def raw_topics(self) -> list[str]:
        return [f"{self.prefix}.raw.{source}" for source in SOURCE_COLUMNS]


def _quoted(names) -> str:
    return ", ".join(f"'{name}'" for name in names)


def check(params: KafkaEngineParams) -> None:
    """Raise StoreError naming the first value that cannot go into the SQL."""
    check_identifier(params.database, "database")
    brokers = params.brokers.replace(" ", "")
    if not _BROKERS.fullmatch(brokers):
        raise StoreError(f"brokers {params.brokers!r}: expected host:port[,host:port...]")
    for what, value in (("prefix", params.prefix), ("group", params.consumer_group())):
        if not _KAFKA_NAME.fullmatch(value):
            raise StoreError(f"{what} {value!r}: letters, digits, '.', '_' and '-' only, 1 to 200 of them")
    for what, value, low, high in (("num_consumers", params.num_consumers, 1, MAX_CONSUMERS),
                                   ("ttl_days", params.ttl_days, 1, 100_000)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise StoreError(f"{what} must be an integer from {low} to {high}, got {value!r}")
    skew = params.max_future_skew_s
    if isinstance(skew, bool) or not isinstance(skew, (int, float)) or not 0 <= skew <= 10 * 365 * 86_400:
        raise StoreError(f"max_future_skew_s must be a number of seconds from 0 to ten years, got {skew!r}")


def render(params: KafkaEngineParams, text: str | None = None) -> str:
    """The SQL file (or `text`) with every placeholder filled; raises StoreError for a value it refuses."""
    check(params)
    if text is None:
        text = (package_dir("fleetscope.sql") / "kafka_engine" / FILE).read_text(encoding="utf-8")
    values = {
        "database": params.database, "brokers": params.brokers.replace(" ", ""),
        "raw_topics": ",".join(params.raw_topics()), "prefix": params.prefix, "group": params.consumer_group(),
        "num_consumers": str(params.num_consumers), "schema_version": str(SCHEMA_VERSION),
        "known_sources": _quoted(SOURCE_COLUMNS), "traced_sources": _quoted(TRACED_SOURCES),
        "ttl_days": str(params.ttl_days), "max_future_skew_ns": str(int(params.max_future_skew_s * 10**9)),
    }
    for name, value in values.items():
        text = text.replace("{" + name + "}", value)
    left = sorted(set(re.findall(r"\{([a-z_]+)\}", text)))
    if left:
        raise StoreError(f"{FILE} has placeholders nothing fills: {left}")
    return text


def statements(params: KafkaEngineParams, text: str | None = None) -> list[str]:
    """The rendered SQL as statements, in order: the Kafka queue table, then the materialized view."""
    return split_statements(render(params, text))
