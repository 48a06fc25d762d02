"""The `fleetscope` command line. Each subcommand is documented in its --help and the README."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from fleetscope import config as config_mod
from fleetscope.cli.global_options import add_global_options
from fleetscope.cli.common import (kafka_or_explain, load_config, open_configured_store, parse_params,
                                   print_native_crashes)
from fleetscope.cli.topic_flags import add_topic_flags, with_topic_flags


def cmd_up(args) -> int:
    from fleetscope.cli.up import run_up
    return run_up(load_config(args), duration_s=args.duration, plain=args.plain, workers=args.workers)


def cmd_agent(args) -> int:
    cfg = with_topic_flags(load_config(args), args)
    if not kafka_or_explain(cfg, "agent"):
        return 2
    from fleetscope.topics import prepare_topics
    from fleetscope.producers.agent import build_agent
    prepare_topics(cfg, cfg.kafka)
    agent = build_agent(cfg, cfg.kafka)
    try:
        agent.run(duration_s=args.duration)
    except KeyboardInterrupt:
        agent.stop()
    return 0


def cmd_streams(args) -> int:
    cfg = with_topic_flags(load_config(args), args)
    if not kafka_or_explain(cfg, "streams"):
        return 2
    from fleetscope.topics import prepare_topics
    prepare_topics(cfg, cfg.kafka)  # a wrong address or login is one line before Faust's seconds of imports
    from fleetscope.streams.worker import run_streams
    run_streams(cfg, cfg.kafka)
    return 0


def cmd_migrate(args) -> int:
    store = open_configured_store(load_config(args))
    try:
        applied = store.migrate()
    finally:
        store.close()
    print("applied: " + ", ".join(applied) if applied else "schema is up to date")
    return 0


def read_query_text(args) -> str:
    """The SQL of `fleetscope query`: the argument, or the file --file names (exactly one of them)."""
    if (args.sql is None) == (args.file is None):
        raise SystemExit("fleetscope query: give the SQL as an argument or with --file PATH, not both or neither")
    if args.file is None:
        return args.sql
    try:
        return Path(args.file).read_text()
    except OSError as exc:
        raise SystemExit(f"fleetscope query: cannot read {args.file}: {exc.strerror}; give a readable SQL file")


def cmd_query(args) -> int:
    from fleetscope.store import StoreError
    sql = read_query_text(args)
    store = open_configured_store(load_config(args))
    try:
        result = store.read_query(sql, parse_params(args.param))  # the query door: read-only
    except StoreError as exc:
        print(f"query failed: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()
    if args.format == "json":
        print(json.dumps(result.as_dicts(), default=str, indent=1))
    elif args.format == "tsv":
        print("\t".join(result.columns))
        for row in result.rows:
            print("\t".join(str(v) for v in row))
    else:
        from rich.console import Console
        from rich.table import Table
        table = Table(*result.columns)
        for row in result.rows:
            table.add_row(*(str(v) for v in row))
        Console().print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fleetscope", description="See inside ML jobs across a GPU fleet.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="embedded all-in-one: broker, streams worker, agent and chDB, with live status")
    up.add_argument("--duration", type=float, help="stop after this many seconds (default: until Ctrl-C)")
    up.add_argument("--plain", action="store_true", help="print a status line per second instead of a live display")
    up.add_argument("--workers", type=int, default=1, help="stream worker processes sharing the partitions (default 1)")
    up.set_defaults(func=cmd_up)

    agent = sub.add_parser("agent", help="run the node agent against FLEETSCOPE_KAFKA")
    agent.add_argument("--duration", type=float, help="stop after this many seconds")
    agent.set_defaults(func=cmd_agent)
    add_topic_flags(agent)

    streams = sub.add_parser("streams", help="run one stream worker against FLEETSCOPE_KAFKA")
    streams.set_defaults(func=cmd_streams)
    add_topic_flags(streams)

    db = sub.add_parser("db", help="store administration")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    db_sub.add_parser("migrate", help="apply pending numbered migrations from sql/").set_defaults(func=cmd_migrate)
    from fleetscope.cli.kafka_engine import register as register_kafka_engine
    register_kafka_engine(db_sub)

    q = sub.add_parser("query", help="run read-only SQL against the store (reaches a running `fleetscope up`)")
    q.add_argument("sql", nargs="?", help="SQL; pass values as {name:Type} placeholders with --param")
    q.add_argument("--file", metavar="PATH", help="read the SQL from this file (e.g. a saved query in sql/queries/)")
    q.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="a query parameter")
    q.add_argument("--format", choices=("table", "json", "tsv"), default="table", help="output format (default: table)")
    q.set_defaults(func=cmd_query)
    from fleetscope.cli.kb import register as register_diagnosis
    register_diagnosis(sub)
    from fleetscope.cli.bench import register as register_bench
    register_bench(sub)
    from fleetscope.cli.demo import register as register_demo
    register_demo(sub)
    from fleetscope.cli.tenants import register as register_tenants
    register_tenants(sub)
    from fleetscope.cli.alert import register as register_alert
    register_alert(sub)
    from fleetscope.cli.sink import register as register_sink
    register_sink(sub)
    from fleetscope.cli.trace import register as register_trace
    register_trace(sub)
    from fleetscope.cli.energy import register as register_energy
    register_energy(sub)
    add_global_options(p)  # last: every subcommand registered above gets them
    return p


def main(argv: list[str] | None = None) -> int:
    print_native_crashes()
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except config_mod.ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # known failures get one clear line, not a traceback
        from fleetscope.broker import BrokerError
        from fleetscope.producers.tenant_sources import TenantMapError
        from fleetscope.store import StoreError
        if isinstance(exc, (StoreError, BrokerError, TenantMapError)):  # TenantMapError: a broken tenant_map_file
            print(f"fleetscope: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
