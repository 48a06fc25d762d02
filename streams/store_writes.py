"""Store inserts that survive an outage and isolate a batch the store rejects.

An insert is a list of parts (raw batches, or rows of a derived table). It
is tried whole; when it fails the store is asked a trivial query:
- no answer: the store is down. StoreUnavailable is raised and the insert
  keeps what is left to do, to be retried later (nothing acknowledged meanwhile);
- an answer: the store is up and refused this data. The parts are bisected;
  halves that go in are done, and a single part refused REJECT_AFTER times
  in a row is handed to `reject` (the dead letters) so it cannot block the rest.

A single part is tried more than once because an up store can still refuse
an insert for a passing reason (too many parts, memory); a poison part fails
the same way every time.

Each piece carries its own dedupe token, derived from the parts it holds, so
a retry after a crash or an outage stores nothing twice.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from fleetscope.wire import StrColumn

REJECT_AFTER = 3


class StoreUnavailable(RuntimeError):
    """The store does not answer: retry later; nothing is lost or acknowledged meanwhile."""


@dataclass
class _Piece:
    parts: list
    failures: int = 0


@dataclass
class Insert:
    table: str
    parts: list
    build: Callable[[list], Any]  # parts -> the columns (or Arrow table) to insert
    token: Callable[[list], str]  # parts -> a dedupe token
    reject: Callable[[Any, str], None]  # one refused part and the store's reason
    todo: list[_Piece] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.parts:
            self.todo = [_Piece(list(self.parts))]

    @property
    def done(self) -> bool:
        return not self.todo

    def run(self, store, on_error: Callable[[BaseException], None] = lambda exc: None) -> None:
        """Store what is left; raise StoreUnavailable if the store is down."""
        while self.todo:
            piece = self.todo[-1]
            try:
                store.insert(self.table, self.build(piece.parts), dedupe_token=self.token(piece.parts))
            except Exception as exc:  # the store's own errors, and data that cannot be converted
                on_error(exc)
                if not store_answers(store):
                    raise StoreUnavailable(f"insert into {self.table}: {exc}") from exc
                if len(piece.parts) > 1:
                    mid = len(piece.parts) // 2
                    self.todo[-1:] = [_Piece(piece.parts[mid:]), _Piece(piece.parts[:mid])]
                    continue
                piece.failures += 1
                if piece.failures < REJECT_AFTER:
                    raise StoreUnavailable(f"insert into {self.table} refused ({piece.failures} of "
                                           f"{REJECT_AFTER} tries before it is dead-lettered): {exc}") from exc
                self.todo.pop()
                self.reject(piece.parts[0], f"store rejected it ({self.table}): {_one_line(exc)}")
                continue
            self.todo.pop()


def store_answers(store) -> bool:
    try:
        store.query("SELECT 1")
        return True
    except Exception:
        return False


def row_insert(table: str, columns: dict, token: str, reject: Callable[[dict, str], None]) -> Insert:
    """An insert of a columnar dict whose parts are its rows (a refused row goes to `reject` as a dict)."""
    n = len(next(iter(columns.values()))) if columns else 0
    full = list(range(n))

    def build(rows: list[int]) -> dict:
        return columns if rows == full else take_rows(columns, rows)

    def piece_token(rows: list[int]) -> str:
        return token if rows == full else f"{token}/{rows[0]}-{rows[-1]}"

    return Insert(table, full, build, piece_token, lambda i, reason: reject(row_of(columns, i), reason))


def take_rows(columns: dict, rows: list[int]) -> dict:
    idx = np.asarray(rows, dtype=np.int64)
    out = {}
    for name, col in columns.items():
        if isinstance(col, StrColumn):
            out[name] = StrColumn(col.codes[idx], col.values)
        elif isinstance(col, np.ndarray):
            out[name] = col[idx]
        else:
            out[name] = [col[i] for i in rows]
    return out


def row_of(columns: dict, i: int) -> dict:
    return {name: (col.values[col.codes[i]] if isinstance(col, StrColumn) else col[i]) for name, col in columns.items()}


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:500]
