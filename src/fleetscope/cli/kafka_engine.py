"""`fleetscope db kafka-engine-sql`: print the SQL that makes a ClickHouse server consume the raw topics
itself (its Kafka engine), the alternative to `fleetscope sink` for raw topics (sql/kafka_engine/)."""
from __future__ import annotations

from fleetscope.cli.common import load_config


def cmd_kafka_engine_sql(args) -> int:
    from fleetscope.store.kafka_engine import KafkaEngineParams, render
    cfg = load_config(args)
    brokers = args.brokers or cfg.kafka
    if not brokers:
        raise SystemExit("fleetscope db kafka-engine-sql: give --brokers HOST:PORT[,HOST:PORT...] "
                         "(as the ClickHouse server reaches Kafka), or set FLEETSCOPE_KAFKA")
    params = KafkaEngineParams(brokers=brokers, prefix=args.prefix or cfg.topic_prefix, database=cfg.database,
                               group=args.group or "", num_consumers=args.consumers, ttl_days=cfg.ttl_days,
                               max_future_skew_s=cfg.max_future_skew_s)
    print(render(params))
    return 0


def register(db_subparsers) -> None:
    p = db_subparsers.add_parser(
        "kafka-engine-sql",
        help="print the SQL for ClickHouse's Kafka engine to store raw topics (instead of `fleetscope sink` for "
             "raw topics; a ClickHouse server only). Run it on the server after `fleetscope db migrate`")
    p.add_argument("--brokers", help="kafka_broker_list as the ClickHouse server reaches Kafka "
                                     "(default: FLEETSCOPE_KAFKA)")
    p.add_argument("--prefix", help="topic prefix (default: the configured topic_prefix)")
    p.add_argument("--group", help="the server's consumer group (default: <prefix>-clickhouse-raw)")
    p.add_argument("--consumers", type=int, default=1,
                   help="kafka_num_consumers, per server; at most the raw topics' partitions (default 1)")
    p.set_defaults(func=cmd_kafka_engine_sql)
