"""Per-tenant read access on a ClickHouse server: a read-only role, row policies, and a user.

A tenant's user reads only rows with `tenant = '<T>'`, in every table that has
a tenant column; the table list is derived from the migrations, so a table a
new migration adds is covered by the next grant. Tables without a tenant
column (schema_migrations, the dlq, whose undecodable messages belong to no
one) are not granted at all.

ClickHouse's rule that shapes this: once a table has any row policy, a user
that no policy covers sees no rows. So each table also gets one permissive
policy, `fleetscope_unrestricted`, `USING 1 TO ALL EXCEPT` the tenants' users
and roles: the workers, migrations and Grafana's own user keep seeing
everything. It is rewritten at every grant and revoke with the current list.

Order matters for what is visible in between: the unrestricted policy first
(nobody loses rows), then the tenant's policies, then the SELECT grant, so the
tenant never has a moment with SELECT but without its filter. Revoke drops
the user first, so nothing is readable while the rest is taken down.

The statements are DDL, which takes no query parameters: the tenant must match
TENANT_RE (Kubernetes namespaces, Slurm accounts), identifiers are derived
from it and backquoted, and the value is single-quoted with escapes on top.
The password never reaches the server: it is sent as its SHA-256 hash.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from fleetscope.store.base import StoreError, check_identifier
from fleetscope.store.migrations import load

TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
USER_PREFIX = "fleetscope_tenant_"
ROLE_SUFFIX = "_reader"
UNRESTRICTED_POLICY = "fleetscope_unrestricted"

_CREATE_TABLE = re.compile(r"CREATE\s+TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?`?(\w+)`?\.`?(\w+)`?\s*\((.*)\)", re.I | re.S)
_ADD_TENANT = re.compile(r"ALTER\s+TABLE\s+`?\w+`?\.`?(\w+)`?\s+.*ADD\s+COLUMN\s+(?:IF\s+NOT\s+EXISTS\s+)?tenant\b",
                         re.I | re.S)
_TENANT_COLUMN = re.compile(r"(?:^|[(,\n])\s*`?tenant`?\s+\w", re.I)


class TenantError(StoreError):
    pass


def check_tenant(tenant: str) -> str:
    if not isinstance(tenant, str) or not TENANT_RE.match(tenant):
        raise TenantError(f"invalid tenant {tenant!r}: must match {TENANT_RE.pattern} "
                          "(a Kubernetes namespace or a Slurm account name)")
    return tenant


def quote_identifier(name: str) -> str:
    return "`" + name.replace("\\", "\\\\").replace("`", "\\`") + "`"


def quote_string(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


@dataclass(frozen=True)
class TenantPrincipals:
    tenant: str

    @property
    def user(self) -> str:
        return USER_PREFIX + check_tenant(self.tenant)

    @property
    def role(self) -> str:
        return self.user + ROLE_SUFFIX


def tenant_tables(database: str, ttl_days: int = 7) -> list[str]:
    """Every table the migrations create that has (or later gets) a tenant column, in migration order."""
    tables: dict[str, bool] = {}
    for migration in load(database, ttl_days):
        for statement in migration.statements:
            created = _CREATE_TABLE.search(statement)
            if created:
                tables[created.group(2)] = bool(_TENANT_COLUMN.search(created.group(3)))
                continue
            added = _ADD_TENANT.search(statement)
            if added and added.group(1) in tables:
                tables[added.group(1)] = True
    return [name for name, has_tenant in tables.items() if has_tenant]


def _table(database: str, table: str) -> str:
    return f"{quote_identifier(database)}.{quote_identifier(table)}"


def _unrestricted(database: str, tables: list[str], tenants: list[str]) -> list[str]:
    """The everything-visible policy for all but the tenants' principals; dropped when no tenant remains."""
    if not tenants:
        return [f"DROP ROW POLICY IF EXISTS {quote_identifier(UNRESTRICTED_POLICY)} ON {_table(database, t)}"
                for t in tables]
    excepted = ", ".join(quote_identifier(name) for t in sorted(set(tenants))
                         for name in (TenantPrincipals(t).user, TenantPrincipals(t).role))
    return [f"CREATE ROW POLICY OR REPLACE {quote_identifier(UNRESTRICTED_POLICY)} ON {_table(database, t)} "
            f"FOR SELECT USING 1 AS PERMISSIVE TO ALL EXCEPT {excepted}" for t in tables]


def grant_statements(tenant: str, database: str, tables: list[str], other_tenants: list[str],
                     password_sha256_hex: str) -> list[str]:
    """The DDL that gives `tenant` a read-only user seeing only its rows. `other_tenants`: those granted before."""
    who = TenantPrincipals(check_tenant(tenant))
    check_identifier(database, "database")
    for t in tables:
        check_identifier(t, "table")
    if not re.fullmatch(r"[0-9a-f]{64}", password_sha256_hex):
        raise TenantError("the password hash must be 64 lowercase hex digits (SHA-256)")
    role, user = quote_identifier(who.role), quote_identifier(who.user)
    statements = [
        f"CREATE ROLE IF NOT EXISTS {role}",
        f"CREATE USER IF NOT EXISTS {user} IDENTIFIED WITH sha256_hash BY {quote_string(password_sha256_hex)} "
        f"SETTINGS readonly = 1",
        f"GRANT {role} TO {user}",
        f"SET DEFAULT ROLE {role} TO {user}",
    ]
    statements += _unrestricted(database, tables, [*other_tenants, tenant])
    statements += [f"CREATE ROW POLICY OR REPLACE {quote_identifier(who.user)} ON {_table(database, t)} "
                   f"FOR SELECT USING tenant = {quote_string(tenant)} AS PERMISSIVE TO {role}" for t in tables]
    statements += [f"GRANT SELECT ON {_table(database, t)} TO {role}" for t in tables]
    return statements


def revoke_statements(tenant: str, database: str, tables: list[str], other_tenants: list[str]) -> list[str]:
    """The DDL that removes `tenant`'s user, role and policies; `other_tenants` keep theirs."""
    who = TenantPrincipals(check_tenant(tenant))
    check_identifier(database, "database")
    for t in tables:
        check_identifier(t, "table")
    role, user = quote_identifier(who.role), quote_identifier(who.user)
    statements = [f"DROP USER IF EXISTS {user}", f"DROP ROLE IF EXISTS {role}"]
    statements += [f"DROP ROW POLICY IF EXISTS {quote_identifier(who.user)} ON {_table(database, t)}" for t in tables]
    statements += _unrestricted(database, tables, [t for t in other_tenants if t != tenant])
    return statements


def password_sha256(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


def granted_tenants(store) -> list[str]:
    """The tenants that have a user on the server (users named fleetscope_tenant_<T>)."""
    result = store.query("SELECT name FROM system.users WHERE startsWith(name, {prefix:String}) ORDER BY name",
                         {"prefix": USER_PREFIX})
    return [row[0][len(USER_PREFIX):] for row in result.rows if TENANT_RE.match(row[0][len(USER_PREFIX):])]
