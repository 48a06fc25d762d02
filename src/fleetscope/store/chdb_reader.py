"""The query door's own chDB session: read-only, time-bounded, beside the worker's.

What chDB 4.4 does here (measured):
- several sessions on one data directory coexist in one process, and a query
  on one does not wait for another: a 3 s read on this session let an insert
  on the worker's session finish in 3 ms;
- `SET readonly=1` holds for this session only; it cannot be lifted from inside
  it, and it refuses SETTINGS clauses, so max_execution_time is set before it;
- after a query stops at max_execution_time, the session's NEXT query returns
  the stopped query's leftover output instead of its own result. So after any
  error the session is closed and the next read opens a fresh one (about 1 ms).
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from fleetscope.store.base import QueryResult, StoreError, check_identifier
from fleetscope.store.read_only import READ_TIMEOUT_S, check_read_only


class ChdbReader:
    def __init__(self, path: Path, database: str, timeout_s: float = READ_TIMEOUT_S) -> None:
        if not timeout_s > 0:
            raise StoreError(f"the read timeout must be positive, got {timeout_s!r}")
        self.path, self.database, self.timeout_s = Path(path), check_identifier(database, "database"), timeout_s
        self._lock = threading.Lock()  # one statement at a time on this session
        self._session = None
        self._closed = False

    def query(self, sql: str, params: dict[str, Any] | None = None) -> QueryResult:
        check_read_only(sql)
        with self._lock:
            if self._closed:
                raise StoreError("the store is closed")
            session = self._session or self._open()
            try:
                res = session.query(sql, "JSONCompact", params=params or {})
            except Exception as exc:
                self._drop()  # see the module note: never reuse a session after a failed query
                raise StoreError(str(exc)) from exc
        return QueryResult.from_json_compact(res.bytes())

    def _open(self):
        from chdb import session  # late: importing chdb loads a large library
        s = session.Session(str(self.path))
        try:
            for stmt in ("SET output_format_json_quote_64bit_integers = 0", "SET session_timezone = 'UTC'",
                         f"USE `{self.database}`", f"SET max_execution_time = {float(self.timeout_s)!r}",
                         "SET readonly = 1"):  # last: after it, nothing in this session can change a setting
                s.query(stmt)
        except Exception as exc:
            s.close()
            raise StoreError(f"cannot open the read-only session on {self.path}: {exc}") from exc
        self._session = s
        return s

    def _drop(self) -> None:
        if self._session is not None:
            try:
                self._session.close()
            finally:
                self._session = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop()
