"""`fleetscope tenants grant|revoke|list`: per-tenant read-only users on a ClickHouse server.

What the statements do is explained in fleetscope.store.tenant_grants. The
embedded chDB has no users, roles or row policies, so against it the command
refuses; `--print` shows the statements to run by hand instead.
"""
from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path

from fleetscope.cli.common import load_config, open_configured_store
from fleetscope.store.tenant_grants import (TenantPrincipals, check_tenant, grant_statements, granted_tenants,
                                            password_sha256, revoke_statements, tenant_tables)

NEEDS_SERVER = ("fleetscope tenants needs a ClickHouse server (set FLEETSCOPE_CLICKHOUSE_URL, with a user allowed "
                "to manage access): the embedded chDB has no users, roles or row policies. "
                "Add --print to see the statements instead.")


def register(subparsers) -> None:
    p = subparsers.add_parser("tenants", help="per-tenant read-only ClickHouse users that see only their own rows")
    sub = p.add_subparsers(dest="tenants_command", required=True)
    grant = sub.add_parser("grant", help="create TENANT's read-only role, its row policies on every table, and a user")
    grant.add_argument("tenant", help="the tenant (a Kubernetes namespace or Slurm account name)")
    grant.add_argument("--password-file", type=Path,
                       help="a file holding the new user's password (default: a generated one, printed once)")
    revoke = sub.add_parser("revoke", help="remove TENANT's user, role and row policies")
    revoke.add_argument("tenant", help="the tenant to remove")
    for cmd in (grant, revoke):
        cmd.add_argument("--print", action="store_true", dest="print_only",
                         help="print the SQL instead of running it (no server needed)")
        cmd.set_defaults(func=run)
    sub.add_parser("list", help="the tenants that have a user on the server").set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args)
    if args.tenants_command != "list":
        check_tenant(args.tenant)
    print_only = getattr(args, "print_only", False)
    if not cfg.clickhouse_url and not print_only:
        print(NEEDS_SERVER, file=sys.stderr)
        return 2
    tables = tenant_tables(cfg.database, cfg.ttl_days)
    store = None if print_only else open_configured_store(cfg)
    try:
        others = [] if store is None else [t for t in granted_tenants(store) if t != getattr(args, "tenant", None)]
        if args.tenants_command == "list":
            print("\n".join(others) if others else "no tenant has a user")
            return 0
        if args.tenants_command == "grant":
            password, generated = _password(args.password_file)
            statements = grant_statements(args.tenant, cfg.database, tables, others, password_sha256(password))
        else:
            generated, statements = None, revoke_statements(args.tenant, cfg.database, tables, others)
        if store is None:
            print(";\n".join(statements) + ";")
        else:
            for statement in statements:
                store.query(statement)
            print(f"{args.tenants_command}: {args.tenant} ({len(tables)} tables: {', '.join(tables)})")
        if generated:
            print(f"password of ClickHouse user {TenantPrincipals(args.tenant).user} (shown once): {generated}",
                  file=sys.stderr)
        return 0
    finally:
        if store is not None:
            store.close()


def _password(path: Path | None) -> tuple[str, str | None]:
    """The password and, when we made it up, the same again to show the user."""
    if path is None:
        generated = secrets.token_urlsafe(24)
        return generated, generated
    try:
        password = path.read_text().rstrip("\r\n")
    except OSError as exc:
        raise SystemExit(f"--password-file {path}: {exc.strerror}") from None
    if not password:
        raise SystemExit(f"--password-file {path} is empty")
    return password, None
