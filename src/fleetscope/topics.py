"""Topic names and creation. Names follow ARCHITECTURE.md's contract."""
from __future__ import annotations

import logging

from fleetscope.config import Config
from fleetscope.schema import SOURCE_COLUMNS

log = logging.getLogger(__name__)

# Every source the schema knows has its raw topic: a new source cannot be published without one.
RAW_SOURCES = tuple(SOURCE_COLUMNS)
DERIVED = ("features", "scores", "anomalies", "diagnoses", "dlq")


def all_topics(cfg: Config) -> list[str]:
    return [cfg.raw_topic(s) for s in RAW_SOURCES] + [cfg.topic(d) for d in DERIVED]


def ensure_topics(bootstrap: str, names: list[str], partitions: int, timeout_s: float = 15.0) -> list[str]:
    """Create the missing topics with `partitions` partitions; return those created."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    existing = set(admin.list_topics(timeout=timeout_s).topics)
    missing = [n for n in names if n not in existing]
    if not missing:
        return []
    futures = admin.create_topics([NewTopic(n, num_partitions=partitions, replication_factor=1) for n in missing],
                                  operation_timeout=timeout_s)
    created = []
    for name, fut in futures.items():
        try:
            fut.result(timeout_s)
            created.append(name)
        except KafkaException as exc:
            if exc.args and exc.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:
                continue  # another process won the race
            raise
    log.info("created topics %s with %d partitions", created, partitions)
    return created
