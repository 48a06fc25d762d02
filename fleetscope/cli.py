"""The `fleetscope` command line. Each subcommand is documented in its --help and the README."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from fleetscope import config as config_mod


def _cfg(args) -> config_mod.Config:
    return config_mod.load(getattr(args, "config", None))


def cmd_up(args) -> int:
    from fleetscope.up import run_up
    return run_up(_cfg(args), duration_s=args.duration, plain=args.plain)


def _kafka_or_explain(cfg, command: str) -> str | None:
    if not cfg.kafka:
        print(f"fleetscope {command} needs a Kafka: set FLEETSCOPE_KAFKA=host:port (or `kafka` in the config file).\n"
              "For everything on this machine with an embedded broker, run `fleetscope up`.", file=sys.stderr)
    return cfg.kafka


def cmd_agent(args) -> int:
    cfg = _cfg(args)
    if not _kafka_or_explain(cfg, "agent"):
        return 2
    from fleetscope.topics import all_topics, ensure_topics
    from producers.agent import build_agent
    ensure_topics(cfg.kafka, all_topics(cfg), cfg.partitions)
    agent = build_agent(cfg, cfg.kafka)
    try:
        agent.run(duration_s=args.duration)
    except KeyboardInterrupt:
        agent.stop()
    return 0


def cmd_streams(args) -> int:
    cfg = _cfg(args)
    if not _kafka_or_explain(cfg, "streams"):
        return 2
    from streams.worker import run_streams
    run_streams(cfg, cfg.kafka)
    return 0


def _store(cfg):
    from fleetscope.store import open_store
    return open_store(cfg.data_dir, cfg.database, cfg.clickhouse_url, cfg.ttl_days)


def cmd_migrate(args) -> int:
    store = _store(_cfg(args))
    try:
        applied = store.migrate()
    finally:
        store.close()
    print("applied: " + ", ".join(applied) if applied else "schema is up to date")
    return 0


def _parse_params(pairs: list[str]) -> dict:
    params = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--param expects NAME=VALUE, got {pair!r}")
        params[name] = value
    return params


def cmd_query(args) -> int:
    from fleetscope.store import StoreError
    store = _store(_cfg(args))
    try:
        result = store.query(args.sql, _parse_params(args.param))
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
    p.add_argument("--config", help="TOML config file (default: $FLEETSCOPE_CONFIG)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="embedded all-in-one: broker, streams worker, agent and chDB, with live status")
    up.add_argument("--duration", type=float, help="stop after this many seconds (default: until Ctrl-C)")
    up.add_argument("--plain", action="store_true", help="print a status line per second instead of a live display")
    up.set_defaults(func=cmd_up)

    agent = sub.add_parser("agent", help="run the node agent against FLEETSCOPE_KAFKA")
    agent.add_argument("--duration", type=float, help="stop after this many seconds")
    agent.set_defaults(func=cmd_agent)

    streams = sub.add_parser("streams", help="run one stream worker against FLEETSCOPE_KAFKA")
    streams.set_defaults(func=cmd_streams)

    db = sub.add_parser("db", help="store administration")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    db_sub.add_parser("migrate", help="apply pending numbered migrations from sql/").set_defaults(func=cmd_migrate)

    q = sub.add_parser("query", help="run SQL against the store (reaches a running `fleetscope up`)")
    q.add_argument("sql", help="SQL; pass values as {name:Type} placeholders with --param")
    q.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="a query parameter")
    q.add_argument("--format", choices=("table", "json", "tsv"), default="table")
    q.set_defaults(func=cmd_query)
    from fleetscope.kb_cli import register as register_diagnosis
    register_diagnosis(sub)
    from fleetscope.bench_cli import register as register_bench
    register_bench(sub)
    from fleetscope.demo import register as register_demo
    register_demo(sub)
    return p


def main(argv: list[str] | None = None) -> int:
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
        from fleetscope.store import StoreError
        if isinstance(exc, (StoreError, BrokerError)):
            print(f"fleetscope: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
