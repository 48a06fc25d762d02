"""Numbered ClickHouse migrations: sql/NNN_name.sql, applied in order.

Each file may hold several statements separated by ';'. Two placeholders
are substituted: `{database}` (a validated identifier) and `{ttl_days}` (an
int). Plain string replacement, not str.format, because DDL can contain
braces of its own (map literals, `{x:Type}` parameters).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fleetscope.resources import package_dir
from fleetscope.store.base import Store, StoreError, check_identifier

# The repository's sql/ directory (fleetscope/store/migrations.py -> repo root).
SQL_DIR = package_dir("fleetscope.sql")
_FILE_RE = re.compile(r"^(\d{3})_([A-Za-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str            # the file stem, e.g. "002_raw_metrics"
    statements: tuple[str, ...]


def discover(sql_dir: Path = SQL_DIR) -> list[tuple[int, Path]]:
    """The numbered migration files, sorted by version; duplicates are an error."""
    found: dict[int, Path] = {}
    for path in sorted(sql_dir.glob("*.sql")):
        m = _FILE_RE.match(path.name)
        if not m:
            continue  # saved analysis queries live here too
        version = int(m.group(1))
        if version in found:
            raise StoreError(f"two migrations share version {version}: {found[version].name}, {path.name}")
        found[version] = path
    return sorted(found.items())


def render(text: str, database: str, ttl_days: int) -> str:
    check_identifier(database, "database")
    if isinstance(ttl_days, bool) or not isinstance(ttl_days, (int, np.integer)) or ttl_days < 1:
        raise StoreError(f"ttl_days must be a positive int, got {ttl_days!r}")
    return text.replace("{database}", database).replace("{ttl_days}", str(int(ttl_days)))


def split_statements(sql: str) -> list[str]:
    """Split on ';' outside quotes and comments; drop comment-only pieces.

    Enough for our DDL: handles '...' and `...` quoting (with backslash and
    doubled-quote escapes), -- line comments and /* */ block comments.
    """
    out: list[str] = []
    buf: list[str] = []
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if c in "'`\"":
            j = i + 1
            while j < n:
                if sql[j] == "\\":
                    j += 2
                    continue
                if sql[j] == c:
                    if j + 1 < n and sql[j + 1] == c:  # doubled quote is an escape
                        j += 2
                        continue
                    break
                j += 1
            buf.append(sql[i:j + 1])
            i = j + 1
        elif sql.startswith("--", i):
            j = sql.find("\n", i)
            i = n if j < 0 else j  # keep the newline as a separator
        elif sql.startswith("/*", i):
            j = sql.find("*/", i + 2)
            i = n if j < 0 else j + 2
            buf.append(" ")
        elif c == ";":
            out.append("".join(buf))
            buf = []
            i += 1
        else:
            buf.append(c)
            i += 1
    out.append("".join(buf))
    return [s.strip() for s in out if s.strip()]


def load(database: str, ttl_days: int, sql_dir: Path = SQL_DIR) -> list[Migration]:
    migrations = []
    for version, path in discover(sql_dir):
        statements = split_statements(render(path.read_text(encoding="utf-8"), database, ttl_days))
        migrations.append(Migration(version, path.stem, tuple(statements)))
    return migrations


def apply(store: Store, database: str, ttl_days: int, sql_dir: Path = SQL_DIR) -> list[str]:
    """Apply pending migrations through `store.query`; return the names applied.

    Every statement is `IF NOT EXISTS`, so a migration interrupted before it
    was recorded simply runs again. The record is inserted with a per-version
    dedupe token, so two processes migrating at once leave one row each.
    """
    migrations = load(database, ttl_days, sql_dir)  # render first: fail before touching the store
    store.query(f"CREATE DATABASE IF NOT EXISTS `{database}`")
    exists = store.query(f"EXISTS TABLE `{database}`.schema_migrations").rows
    done: set[int] = set()
    if exists and exists[0][0]:
        done = {int(r[0]) for r in store.query(f"SELECT version FROM `{database}`.schema_migrations").rows}
    applied = []
    for mig in migrations:
        if mig.version in done:
            continue
        for stmt in mig.statements:
            store.query(stmt)
        store.insert("schema_migrations",
                     {"version": np.array([mig.version], dtype=np.uint32), "name": [mig.name]},
                     dedupe_token=f"migration-{mig.version}")
        applied.append(mig.name)
    return applied
