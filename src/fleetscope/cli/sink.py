"""`fleetscope sink`: store the raw and derived topics of FLEETSCOPE_KAFKA in the configured store."""
from __future__ import annotations

from fleetscope.cli.common import kafka_or_explain, load_config


def cmd_sink(args) -> int:
    cfg = load_config(args)
    if not kafka_or_explain(cfg, "sink"):
        return 2
    from fleetscope.streams.sink.service import run_sink
    run_sink(cfg, cfg.kafka, raw=not args.no_raw)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("sink", help="store raw and derived topics from FLEETSCOPE_KAFKA into the store "
                                           "(any number against a ClickHouse server; one on chDB)")
    p.add_argument("--no-raw", action="store_true",
                   help="leave the raw topics to ClickHouse's Kafka engine (`fleetscope db kafka-engine-sql`); "
                        "store only the derived topics, the DLQ and model state")
    p.set_defaults(func=cmd_sink)
