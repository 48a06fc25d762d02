"""The production store: a ClickHouse server, through clickhouse-connect (HTTP).

Credentials come from the URL (http://user:pass@host:8123) or from the
environment: FLEETSCOPE_CLICKHOUSE_USER, FLEETSCOPE_CLICKHOUSE_PASSWORD or
FLEETSCOPE_CLICKHOUSE_PASSWORD_FILE (a file holding the password, e.g. a
mounted secret). Never from code or config files. The URL's own values win;
then the PASSWORD variable, then the file. Messages show the URL redacted.

Query values are bound server-side: clickhouse-connect sends `{x:Type}`
parameters as HTTP query parameters, never spliced into SQL.

The query door (read_query) sends readonly=2 with each query: DDL and DML are
refused by the server, and max_execution_time can still travel with the query
(readonly=1 would refuse that setting). readonly=2 lets table functions run,
so read_only.check_read_only refuses them first. A user whose profile is
already read-only (a tenant's, see tenant_grants.py) may not send settings at
all, so for it the door sends none and the profile's limits hold. Not
exercised against a server here: there is none on the test machines.
"""
from __future__ import annotations

import datetime as dt
import decimal
import ipaddress
import math
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import unquote, urlsplit, urlunsplit

import numpy as np

from fleetscope.store.base import ColumnData, Prepared, QueryResult, StoreError, datetime_precision
from fleetscope.store.read_only import READ_TIMEOUT_S, check_read_only
from fleetscope.store.sql_store import SqlStore
from fleetscope.wire import StrColumn

ENV_USER = "FLEETSCOPE_CLICKHOUSE_USER"
ENV_PASSWORD = "FLEETSCOPE_CLICKHOUSE_PASSWORD"
ENV_PASSWORD_FILE = "FLEETSCOPE_CLICKHOUSE_PASSWORD_FILE"
_SCHEMES = {"http": "http", "https": "https", "clickhouse": "http"}


@dataclass(frozen=True)
class Connection:
    dsn: str                 # the URL without credentials
    interface: str           # "http" | "https"
    username: str | None
    password: str = ""

    def __repr__(self) -> str:  # never print the password
        return f"Connection(dsn={self.dsn!r}, interface={self.interface!r}, username={self.username!r})"


def redact(url: str) -> str:
    """The URL with any password replaced by ***, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


def resolve_connection(url: str, env: Mapping[str, str] | None = None) -> Connection:
    """Split a ClickHouse URL into a credential-free DSN plus user and password."""
    env = os.environ if env is None else env
    parts = urlsplit(url)
    if parts.scheme not in _SCHEMES or not parts.hostname:
        raise StoreError(f"ClickHouse URL {redact(url)!r} must look like http(s)://[user[:password]@]host[:port][/database]")
    username = unquote(parts.username) if parts.username else env.get(ENV_USER) or None
    if parts.password is not None:
        password = unquote(parts.password)
    elif env.get(ENV_PASSWORD):
        password = env[ENV_PASSWORD]
    elif env.get(ENV_PASSWORD_FILE):
        try:
            password = Path(env[ENV_PASSWORD_FILE]).read_text(encoding="utf-8").rstrip("\r\n")
        except OSError as exc:
            raise StoreError(f"cannot read {ENV_PASSWORD_FILE}={env[ENV_PASSWORD_FILE]!r}: {exc.strerror}") from None
    else:
        password = ""
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    dsn = urlunsplit(("https" if _SCHEMES[parts.scheme] == "https" else "http", netloc, parts.path, parts.query, ""))
    return Connection(dsn, _SCHEMES[parts.scheme], username, password)


def to_server_column(c: Prepared) -> list:
    """One prepared column as the Python values clickhouse-connect writes."""
    if c.kind == "time":
        # clickhouse-connect writes Python ints as raw ticks of the column's precision.
        return (c.data // 10 ** (9 - datetime_precision(c.ch_type))).tolist()
    if c.kind == "str":
        return (c.data.to_numpy() if isinstance(c.data, StrColumn) else c.data).tolist()
    if c.kind == "nested":
        return c.data
    return np.asarray(c.data).tolist()


def jsonable(v: Any) -> Any:
    """A value from clickhouse-connect as JSON-safe Python, like chDB's JSON output."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None  # ClickHouse's JSON writes nan/inf as null
    if isinstance(v, dt.datetime):
        if v.tzinfo is not None:
            v = v.astimezone(dt.timezone.utc).replace(tzinfo=None)
        return v.isoformat(sep=" ")
    if isinstance(v, (dt.date, dt.time)):
        return v.isoformat()
    if isinstance(v, decimal.Decimal):
        return float(v)
    if isinstance(v, (uuid.UUID, ipaddress.IPv4Address, ipaddress.IPv6Address)):
        return str(v)
    if isinstance(v, (bytes, bytearray)):
        return v.decode("utf-8", errors="replace")
    if isinstance(v, dict):
        return {str(jsonable(k)): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, np.ndarray)):
        return [jsonable(x) for x in v]
    if isinstance(v, np.generic):
        return jsonable(v.item())
    return str(v)


class ClickHouseServerStore(SqlStore):
    def __init__(self, url: str, database: str = "fleetscope", ttl_days: int = 7,
                 read_timeout_s: float = READ_TIMEOUT_S) -> None:
        super().__init__(database, ttl_days)
        self.read_timeout_s = read_timeout_s
        self._profile_readonly: int | None = None  # the user's own readonly level, read on first use
        conn = resolve_connection(url)
        self.url = redact(url)
        import clickhouse_connect  # late: only this backend needs it

        try:
            # No session id: the HTTP client is then safe to share between threads.
            self._client = clickhouse_connect.get_client(
                dsn=conn.dsn, interface=conn.interface, username=conn.username, password=conn.password,
                autogenerate_session_id=False)
            self._client.command(f"CREATE DATABASE IF NOT EXISTS `{self.database}`")
        except Exception as exc:
            raise StoreError(f"cannot reach ClickHouse at {self.url}: {exc}") from exc
        self._client.database = self.database  # unqualified names resolve in our database

    def query(self, sql: str, params: dict[str, Any] | None = None) -> QueryResult:
        return self._query(sql, params, None)

    def read_query(self, sql: str, params: dict[str, Any] | None = None) -> QueryResult:
        check_read_only(sql)
        if self._profile_readonly is None:
            self._profile_readonly = int(self._query("SELECT toUInt8(getSetting('readonly'))", None, None).rows[0][0])
        if self._profile_readonly:
            return self._query(sql, params, None)  # read-only already, and may not change settings
        return self._query(sql, params, {"readonly": 2, "max_execution_time": self.read_timeout_s})

    def _query(self, sql: str, params: dict[str, Any] | None, settings: dict | None) -> QueryResult:
        try:
            res = self._client.query(sql, parameters=params or None, settings=settings)
        except Exception as exc:
            raise StoreError(str(exc)) from exc
        return QueryResult(list(res.column_names or ()), [tuple(jsonable(v) for v in row) for row in res.result_rows])

    def insert(self, table: str, columns: dict[str, ColumnData], dedupe_token: str | None = None) -> int:
        cols, n = self.prepare_insert(table, columns, dedupe_token)
        if n == 0:
            return 0
        settings = {"insert_deduplication_token": dedupe_token} if dedupe_token is not None else None
        try:
            self._client.insert(table, [to_server_column(c) for c in cols], column_names=[c.name for c in cols],
                                database=self.database, column_type_names=[c.ch_type for c in cols],
                                column_oriented=True, settings=settings)
        except Exception as exc:
            raise StoreError(f"insert into {table} failed: {exc}") from exc
        return n

    def close(self) -> None:
        self._client.close()
