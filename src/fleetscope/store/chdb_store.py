"""The embedded store: chDB, the ClickHouse engine inside this process.

Two chDB facts shape this file:
- one process per data directory: a second process fails with "Error
  initializing EmbeddedServer" (we raise StoreBusyError), and one process
  can hold only one data directory at a time;
- the session is not thread-safe, so every call takes `_lock`;
- the query door (read_query: `fleetscope query`, the endpoint) runs on a
  second, read-only session of the same directory (chdb_reader.py), so a long
  read never holds `_lock` while the worker inserts;
- the data directory is 0700 and files chDB writes are 0600 (umask 077 while
  the store is open).

Inserts go through `INSERT ... SELECT ... FROM Python(df)`: chDB reads the
pandas DataFrame named `df` from the calling frame's locals, at memory speed.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fleetscope.store.base import (ColumnData, Prepared, QueryResult, StoreBusyError, StoreError, check_identifier,
                                   json_default)
from fleetscope.store.chdb_reader import ChdbReader
from fleetscope.store.read_only import READ_TIMEOUT_S
from fleetscope.store.sql_store import SqlStore
from fleetscope.wire import StrColumn

BUSY_MESSAGE = ("the chDB data directory {path} is held by another fleetscope process "
                "(chDB allows one process per data directory). Keep `fleetscope up` running so its "
                "query endpoint (endpoint.json in the data dir) serves other commands, or stop the "
                "other process and try again.")


class ChdbStore(SqlStore):
    def __init__(self, path: Path, database: str = "fleetscope", ttl_days: int = 7,
                 read_timeout_s: float = READ_TIMEOUT_S) -> None:
        super().__init__(database, ttl_days)
        from chdb import session  # late: importing chdb loads a large library

        self.path = Path(path)
        self._umask_before = _private_umask()
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path.chmod(0o700)  # also a directory made by an older version: the data is private
        self._lock = threading.Lock()
        try:
            self._session = session.Session(str(self.path))
        except Exception as exc:  # chDB raises a bare RuntimeError
            os.umask(self._umask_before)
            if "Error initializing EmbeddedServer" in str(exc):
                raise StoreBusyError(BUSY_MESSAGE.format(path=self.path)) from exc
            if "EmbeddedServer already initialized" in str(exc):
                raise StoreError(f"this process already has another chDB data directory open; close that "
                                 f"store before opening {self.path} ({exc})") from exc
            raise StoreError(f"cannot open chDB at {self.path}: {exc}") from exc
        # 64-bit ints as JSON numbers, not strings, so rows come back typed.
        self._run("SET output_format_json_quote_64bit_integers = 0")
        # Naive time strings (e.g. a {since:DateTime64(9)} parameter) mean UTC, whatever
        # the laptop's time zone: every time column in our tables is UTC.
        self._run("SET session_timezone = 'UTC'")
        self._run(f"CREATE DATABASE IF NOT EXISTS `{self.database}`")
        self._run(f"USE `{self.database}`")  # unqualified names resolve in our database
        # The query door reads on its own session: it never waits for, nor holds up, the inserts.
        self._reader = ChdbReader(self.path, self.database, read_timeout_s)

    def _run(self, sql: str, params: dict[str, Any] | None = None) -> QueryResult:
        with self._lock:
            if self._session is None:
                raise StoreError("the store is closed")
            try:
                res = self._session.query(sql, "JSONCompact", params=params or {})
            except Exception as exc:
                raise StoreError(str(exc)) from exc
        return QueryResult.from_json_compact(res.bytes())

    def query(self, sql: str, params: dict[str, Any] | None = None) -> QueryResult:
        return self._run(sql, params)

    def read_query(self, sql: str, params: dict[str, Any] | None = None) -> QueryResult:
        return self._reader.query(sql, params)

    def insert(self, table: str, columns: dict[str, ColumnData], dedupe_token: str | None = None) -> int:
        if _is_flat_arrow(columns):
            return self._insert_arrow(table, columns, dedupe_token)
        cols, n = self.prepare_insert(table, columns, dedupe_token)
        if n == 0:
            return 0
        try:
            df = pd.DataFrame({c.name: _frame_column(c) for c in cols}, copy=False)
        except (TypeError, ValueError) as exc:  # e.g. NaN inside an Array column
            raise StoreError(f"insert into {table}: {exc}") from None
        names = ", ".join(f"`{c.name}`" for c in cols)
        exprs = ", ".join(_select_expr(c) for c in cols)
        self._insert_from_python(table, names, exprs, df, dedupe_token)
        return n

    def _insert_arrow(self, table: str, tbl, dedupe_token: str | None) -> int:
        """The hot path for the stream worker's raw rows: chDB reads the Arrow
        buffers directly, about 3x faster than going through pandas."""
        check_identifier(table, "table name")
        self.check_token(dedupe_token)
        known = self.column_types(table)
        for name in tbl.column_names:
            check_identifier(name, "column name")
            if name not in known:
                raise StoreError(f"insert into {table}: no column {name!r}")
        if tbl.num_rows == 0:
            return 0
        names = ", ".join(f"`{c}`" for c in tbl.column_names)
        self._insert_from_python(table, names, names, tbl, dedupe_token)
        return tbl.num_rows

    def _insert_from_python(self, table: str, names: str, exprs: str, data, dedupe_token: str | None) -> None:
        """INSERT ... SELECT exprs FROM Python(data), with the dedupe token as a parameter.

        chDB resolves Python(data) from the locals of the frame that calls query(),
        which is this one: `data` must stay a local here."""
        sql = f"INSERT INTO `{self.database}`.`{table}` ({names}) SELECT {exprs} FROM Python(data)"
        params: dict[str, Any] = {}
        if dedupe_token is not None:
            sql += " SETTINGS insert_deduplication_token = {fs_dedupe_token:String}"
            params["fs_dedupe_token"] = dedupe_token
        with self._lock:
            if self._session is None:
                raise StoreError("the store is closed")
            try:
                self._session.query(sql, "JSONCompact", params=params)
            except Exception as exc:
                raise StoreError(f"insert into {table} failed: {exc}") from exc

    def close(self) -> None:
        if getattr(self, "_reader", None) is not None:
            self._reader.close()
        with self._lock:
            if self._session is not None:
                self._session.close()
                self._session = None
                os.umask(self._umask_before)


def _private_umask() -> int:
    """Make files created from now on private to this user; return the mask before.

    chDB writes parts from its own threads for as long as the store is open, so
    the mask is the process's until close(). The process holding chDB is
    fleetscope's own (up, streams), never the traced workload."""
    before = os.umask(0o077)
    os.umask(before | 0o077)
    return before


def _is_flat_arrow(data) -> bool:
    """An Arrow table of plain numbers, strings and timestamps (no maps or lists)."""
    if not (type(data).__module__.startswith("pyarrow") and hasattr(data, "schema")):
        return False
    import pyarrow.types as pat
    return all(pat.is_integer(f.type) or pat.is_floating(f.type) or pat.is_string(f.type)
               or pat.is_timestamp(f.type) for f in data.schema)


def _frame_column(c: Prepared):
    if c.kind == "nested":
        # Python(df) would infer dicts as JSON and lists as String, neither of which
        # casts to Map/Array; JSON text + JSONExtract into the exact type does.
        return np.array([json.dumps(v, allow_nan=False, default=json_default) for v in c.data], dtype=object)
    if c.kind == "str" and isinstance(c.data, StrColumn):
        try:  # categorical keeps the dictionary encoding all the way in
            return pd.Categorical.from_codes(c.data.codes.astype(np.int32, copy=False), categories=list(c.data.values))
        except ValueError:  # duplicate dictionary entries: decode instead
            return c.data.to_numpy()
    return c.data


def _select_expr(c: Prepared) -> str:
    col = f"`{c.name}`"
    if c.kind == "time":
        # Explicit ns -> UTC conversion: no dependence on the process time zone.
        return f"fromUnixTimestamp64Nano({col}, 'UTC')"
    if c.kind == "nested":
        # The type comes from our own table's metadata, not from the caller; quote it as a literal.
        return f"JSONExtract({col}, '{c.ch_type.replace(chr(39), chr(92) + chr(39))}')"
    return col
