"""The store interface every backend implements, and the helpers they share.

Backends: ChdbStore (in-process engine), ClickHouseServerStore (a server),
RemoteStore (another process's chDB, through its loopback endpoint).

Insert data is columnar: `{column: array}` (a pyarrow Table is accepted
too). What each column may be depends on the table's column type, which the
store looks up once per table:

- time columns (DateTime64 / DateTime): numpy datetime64 (any unit, read as
  UTC) or integers meaning nanoseconds since the Unix epoch. Pass the whole
  ns value even for a DateTime64(3) column; the store truncates.
- string columns: a wire.StrColumn, a numpy array or a list of str.
- Map / Array / Tuple columns: a list of dicts / lists / tuples. A Map entry
  whose value is NaN or inf is dropped: a masked feature is an absent key.
- numeric columns: a numpy array or a list.

Columns the caller leaves out get the table's defaults. SQL values never go
into SQL text: queries take `{name:Type}` parameters, inserts take data.
Identifiers (database, table, column names) are checked against IDENT.

This module imports nothing else of the store: migrations.py builds on it, and
sql_store.py (what the SQL backends share) builds on both.
"""
from __future__ import annotations

import json
import math
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from fleetscope.wire import StrColumn

IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

ColumnData = np.ndarray | StrColumn | list


class StoreError(RuntimeError):
    """A store operation failed; the message says what and, where known, why."""


class StoreBusyError(StoreError):
    """The chDB data directory is held by another process."""


def check_identifier(name: str, what: str = "identifier") -> str:
    if not isinstance(name, str) or not IDENT.match(name):
        raise StoreError(f"invalid {what} {name!r}: must match {IDENT.pattern}")
    return name


@dataclass
class QueryResult:
    columns: list[str] = field(default_factory=list)
    rows: list[tuple] = field(default_factory=list)  # JSON-safe Python values

    def as_dicts(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, row)) for row in self.rows]

    @classmethod
    def from_json_compact(cls, text: bytes | str) -> "QueryResult":
        """Parse ClickHouse's JSONCompact output (what both engines return).

        Statements without a result set (DDL, INSERT) return no text at all.
        """
        if not text or not text.strip():
            return cls()
        doc = json.loads(text)
        return cls([m["name"] for m in doc.get("meta", [])], [tuple(r) for r in doc.get("data", [])])


class Store(ABC):
    database: str

    @abstractmethod
    def migrate(self) -> list[str]:
        """Apply pending sql/NNN_*.sql migrations in order; return the names applied."""

    @abstractmethod
    def insert(self, table: str, columns: dict[str, ColumnData], dedupe_token: str | None = None) -> int:
        """Insert one columnar batch in one INSERT; return the number of rows sent.

        With a dedupe_token, a second insert of the same token into the same
        table is dropped by the engine (sinks pass the batch id). A dropped
        retry still returns the batch's row count: those rows are stored.
        `columns` may also be a pyarrow Table.
        """

    @abstractmethod
    def query(self, sql: str, params: dict[str, Any] | None = None) -> QueryResult:
        """Run one statement; values go in `{name:Type}` placeholders via params.

        Unqualified table names resolve in the store's database.
        """

    @abstractmethod
    def read_query(self, sql: str, params: dict[str, Any] | None = None) -> QueryResult:
        """The query door: run one statement from outside (`fleetscope query`, the endpoint).

        Only statements that read the store get through (read_only.check_read_only),
        the engine runs them read-only, and each has a max_execution_time. `query`
        is the worker's internal path and stays unrestricted.
        """

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- helpers for the SQL backends (chDB, server) -------------------------------

@dataclass(frozen=True)
class Prepared:
    """One insert column, normalised by what the target column needs."""
    name: str
    kind: str        # "time" | "nested" | "str" | "num"
    ch_type: str     # the table's column type, e.g. "DateTime64(3, 'UTC')"
    data: Any        # time: int64 ns ndarray; nested: list; str: StrColumn | ndarray; num: ndarray


def column_kind(ch_type: str) -> str:
    base = ch_type
    for wrapper in ("LowCardinality(", "Nullable("):  # wrappers don't change what we send
        while base.startswith(wrapper):
            base = base[len(wrapper):-1]
    if base.startswith(("DateTime64", "DateTime")):
        return "time"
    if base.startswith(("Map(", "Array(", "Tuple(")):
        return "nested"
    if base.startswith(("String", "FixedString", "Enum", "UUID", "IPv")):
        return "str"
    return "num"


def datetime_precision(ch_type: str) -> int:
    """Digits after the second for a DateTime64(p, ...) type; 0 for DateTime."""
    m = re.search(r"DateTime64\((\d+)", ch_type)
    return int(m.group(1)) if m else 0


def prepare_columns(table: str, columns: dict[str, ColumnData], types: dict[str, str]) -> tuple[list[Prepared], int]:
    """Check names and lengths and normalise each column; returns (columns, rows)."""
    columns = columns_of(columns)
    if not columns:
        raise StoreError(f"insert into {table}: no columns given")
    unknown = [c for c in columns if c not in types]
    if unknown:
        raise StoreError(f"insert into {table}: unknown columns {unknown}; table has {list(types)}")
    lengths = {name: len(col) for name, col in columns.items()}
    if len(set(lengths.values())) != 1:
        raise StoreError(f"insert into {table}: columns differ in length: {lengths}")
    out = []
    for name, col in columns.items():
        check_identifier(name, "column name")
        ch_type = types[name]
        kind = column_kind(ch_type)
        try:
            data = _NORMALISE[kind](col)
        except (TypeError, ValueError) as exc:
            raise StoreError(f"insert into {table}: column {name} ({ch_type}): {exc}") from None
        out.append(Prepared(name, kind, ch_type, data))
    return out, next(iter(lengths.values()))


def columns_of(data: Any) -> dict[str, ColumnData]:
    """The insert data as {name: column}; also accepts a pyarrow Table.

    Arrow tables are converted column by column (no pyarrow import unless one
    is passed): timestamps become datetime64, strings object arrays, maps
    dicts, lists lists.
    """
    if isinstance(data, dict):
        return data
    if type(data).__module__.startswith("pyarrow") and hasattr(data, "column_names"):
        return {name: _arrow_column(data.column(name)) for name in data.column_names}
    raise StoreError(f"insert data must be a dict of columns or a pyarrow Table, not {type(data).__name__}")


def _arrow_column(col: Any) -> ColumnData:
    kind = str(col.type)
    if kind.startswith("map<"):
        return [dict(v) if v is not None else {} for v in col.to_pylist()]  # arrow maps come as (k, v) pairs
    if kind.startswith(("list<", "large_list<", "fixed_size_list<", "struct<")):
        return col.to_pylist()
    return col.to_numpy()


def _time_ns(col: ColumnData) -> np.ndarray:
    if isinstance(col, StrColumn):
        raise TypeError("a time column cannot be a string column")
    arr = np.asarray(col)
    if np.issubdtype(arr.dtype, np.datetime64):
        return arr.astype("datetime64[ns]").view(np.int64)
    if arr.size == 0:
        return arr.astype(np.int64)
    if np.issubdtype(arr.dtype, np.integer):
        return arr.astype(np.int64, copy=False)
    raise TypeError(f"expected datetime64 or int64 ns since the epoch, got {arr.dtype}")


def _nested(col: ColumnData) -> list:
    if isinstance(col, StrColumn):
        raise TypeError("a Map/Array column cannot be a string column")
    values = col.tolist() if isinstance(col, np.ndarray) else list(col)
    return [_drop_nonfinite_map_values(v) if isinstance(v, dict) else v for v in values]


def _drop_nonfinite_map_values(d: dict) -> dict:
    return {str(k): v for k, v in d.items() if not (isinstance(v, (float, np.floating)) and not math.isfinite(v))}


def _strings(col: ColumnData) -> StrColumn | np.ndarray:
    if isinstance(col, StrColumn):
        return col
    return np.asarray(col, dtype=object)


def _numbers(col: ColumnData) -> np.ndarray:
    if isinstance(col, StrColumn):
        raise TypeError("a numeric column cannot be a string column")
    arr = np.asarray(col)
    if arr.dtype == object:
        raise TypeError("expected numbers, got Python objects")
    return arr


_NORMALISE = {"time": _time_ns, "nested": _nested, "str": _strings, "num": _numbers}


def json_default(obj: Any) -> Any:
    """json.dumps fallback for numpy values inside nested columns."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON-serialisable")


def as_list(col: ColumnData) -> Sequence:
    """A column as plain Python values (for JSON transport)."""
    if isinstance(col, StrColumn):
        return col.to_numpy().tolist()
    if isinstance(col, np.ndarray):
        if np.issubdtype(col.dtype, np.datetime64):
            return col.astype("datetime64[ns]").view(np.int64).tolist()
        return col.tolist()
    return list(col)
