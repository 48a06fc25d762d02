"""Topic names, topology and creation. Names follow ARCHITECTURE.md's contract.

Creating topics is an admin's right on a managed cluster: with `create_topics`
off (`--no-create-topics`) fleetscope only checks that the topics exist and
says which are missing. The ACLs each role needs are in the README (Deploy).
"""
from __future__ import annotations

import logging
import time

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from fleetscope.config import Config, ConfigError
from fleetscope.kafka_settings import KafkaUnreachable, client_conf, explain_failure, is_fatal_at_start
from fleetscope.schema import SOURCE_COLUMNS

log = logging.getLogger(__name__)

# Every source the schema knows has its raw topic: a new source cannot be published without one.
RAW_SOURCES = tuple(SOURCE_COLUMNS)
# traces: per-call records the agents capture around anomalies (JSON, fleetscope/trace_message.py)
# control: live capture requests to the agents (`fleetscope trace --live`; JSON, fleetscope/capture_request.py)
DERIVED = ("features", "scores", "anomalies", "diagnoses", "dlq", "traces", "control")
MODEL_STATE = "model-state"  # compacted, keyed by tenant/job: the latest state of each job wins
TOPIC_CONFIG = {MODEL_STATE: {"cleanup.policy": "compact"}}
BROKER_DEFAULT_REPLICATION = -1  # CreateTopics with -1 takes the broker's default.replication.factor (KIP-464)


def all_topics(cfg: Config) -> list[str]:
    return [cfg.raw_topic(s) for s in RAW_SOURCES] + [cfg.topic(d) for d in DERIVED] + [cfg.topic(MODEL_STATE)]


def topic_config(name: str) -> dict[str, str]:
    """Per-topic settings at creation (by the name's suffix after the prefix)."""
    return next((conf for suffix, conf in TOPIC_CONFIG.items() if name.endswith("." + suffix)), {})


def partitions_by_topic(cfg: Config) -> dict[str, int]:
    """Each topic's partition count: `topic_partitions` entries ("features=8", "raw.nvml=12") over `partitions`."""
    counts = {name: cfg.partitions for name in all_topics(cfg)}
    for entry in cfg.topic_partitions:
        suffix, sep, count = entry.partition("=")
        name = cfg.topic(suffix.strip())
        if not sep or name not in counts:
            raise ConfigError(f"topic_partitions entry {entry!r}: expected NAME=COUNT with NAME one of "
                              f"{[n[len(cfg.topic_prefix) + 1:] for n in counts]}")
        try:
            counts[name] = int(count)
        except ValueError:
            counts[name] = 0
        if counts[name] < 1:
            raise ConfigError(f"topic_partitions entry {entry!r}: the count must be an integer >= 1")
    return counts


def quiet_admin(cfg: Config, bootstrap: str):
    """An AdminClient that keeps librdkafka's retry log to itself, and the list its errors are collected in."""
    errors: list = []
    return AdminClient(client_conf(cfg, bootstrap, log_level=0, error_cb=errors.append)), errors


def list_topic_names(cfg: Config, bootstrap: str, quiet=None) -> set[str]:
    """The cluster's topics, or KafkaUnreachable with one line saying what to check.

    Waits at most `kafka_connect_timeout_s`, and stops at once on a refusal (authentication, TLS) that
    retrying cannot cure.
    """
    admin, errors = quiet or quiet_admin(cfg, bootstrap)
    timeout_s = cfg.kafka_connect_timeout_s
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        try:
            return set(admin.list_topics(timeout=min(0.5, max(0.05, deadline - time.monotonic()))).topics)
        except KafkaException as exc:
            last = exc.args[0] if exc.args else None
        admin.poll(0)  # serves error_cb
        fatal = [e for e in errors if is_fatal_at_start(e.name())]
        if fatal or time.monotonic() >= deadline:
            reason = fatal[0] if fatal else (errors[-1] if errors else last)
            name = reason.name() if reason is not None else None
            detail = reason.str() if reason is not None else "no answer"
            raise KafkaUnreachable(explain_failure(cfg, bootstrap, name, detail, timeout_s))


def prepare_topics(cfg: Config, bootstrap: str) -> list[str]:
    """Check that Kafka answers, then create the missing topics (or, with create_topics off, require them).

    Returns the topics created.
    """
    quiet = quiet_admin(cfg, bootstrap)
    existing = list_topic_names(cfg, bootstrap, quiet)
    missing = [n for n in all_topics(cfg) if n not in existing]
    if not missing:
        return []
    if not cfg.create_topics:
        raise KafkaUnreachable(f"topics missing on Kafka at {bootstrap}: {', '.join(missing)}; ask the cluster's "
                               "admin to create them (README: Deploy, topics), or run without --no-create-topics "
                               "as a principal allowed to create topics")
    counts = partitions_by_topic(cfg)
    return _create(quiet[0], {n: counts[n] for n in missing}, cfg.topic_replication, timeout_s=15.0)


def ensure_topics(bootstrap: str, names: list[str], partitions: int, timeout_s: float = 15.0,
                  replication: int = BROKER_DEFAULT_REPLICATION) -> list[str]:
    """Create the missing topics with `partitions` partitions on an unsecured broker; return those created.

    For the embedded broker and tests; a configured cluster goes through prepare_topics.
    """
    admin = AdminClient({"bootstrap.servers": bootstrap})
    existing = set(admin.list_topics(timeout=timeout_s).topics)
    missing = {n: partitions for n in names if n not in existing}
    return _create(admin, missing, replication, timeout_s) if missing else []


def _create(admin, partitions: dict[str, int], replication: int, timeout_s: float) -> list[str]:
    futures = admin.create_topics([NewTopic(n, num_partitions=p, replication_factor=replication, config=topic_config(n))
                                   for n, p in partitions.items()], operation_timeout=timeout_s)
    created = []
    for name, fut in futures.items():
        try:
            fut.result(timeout_s)
            created.append(name)
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            if error is not None and error.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                continue  # another process won the race
            if error is not None and error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
                raise KafkaUnreachable(f"not allowed to create topic {name}: grant this principal CREATE on the "
                                       "cluster, or have an admin create the topics and pass --no-create-topics") from None
            raise
    log.info("created topics %s (replication %s)", {n: partitions[n] for n in created},
             "broker default" if replication == BROKER_DEFAULT_REPLICATION else replication)
    return created
