"""Storage backends behind one interface (see base.Store).

open_store picks the backend:
1. a ClickHouse server, when a URL is configured (production);
2. the endpoint of the process that already holds the local chDB
   (`fleetscope up`), when data_dir/endpoint.json names a live one;
3. chDB in this process, in data_dir/chdb.
"""
from __future__ import annotations

from pathlib import Path

from fleetscope.store.base import QueryResult, Store, StoreBusyError, StoreError, check_identifier
from fleetscope.store.clickhouse_store import ClickHouseServerStore
from fleetscope.store.endpoint import QueryEndpoint, RemoteStore, endpoint_alive

__all__ = ["open_store", "Store", "QueryResult", "StoreError", "StoreBusyError", "ChdbStore",
           "ClickHouseServerStore", "RemoteStore", "QueryEndpoint", "endpoint_alive", "check_identifier"]


def open_store(data_dir: Path, database: str = "fleetscope", clickhouse_url: str | None = None,
               ttl_days: int = 7, prefer_endpoint: bool = True) -> Store:
    check_identifier(database, "database")
    if clickhouse_url:
        return ClickHouseServerStore(clickhouse_url, database, ttl_days)
    data_dir = Path(data_dir)
    if prefer_endpoint and endpoint_alive(data_dir):
        remote = RemoteStore(data_dir)
        if remote.database != database:
            raise StoreError(f"the fleetscope process serving {data_dir} uses database {remote.database!r}, "
                             f"not {database!r}")
        return remote
    # ChdbStore raises StoreBusyError, with what to do, if another process holds it.
    return _chdb_store_class()(data_dir / "chdb", database, ttl_days)


def _chdb_store_class():
    """The embedded backend, imported only when used: chDB and pandas come with the [embedded] extra, and the
    agent and server-backed worker images install the core only."""
    try:
        from fleetscope.store.chdb_store import ChdbStore
    except ImportError as exc:
        raise StoreError(f"the embedded store needs chDB ({exc}): install fleetscope[embedded], or set "
                         "FLEETSCOPE_CLICKHOUSE_URL to use a ClickHouse server") from None
    return ChdbStore


def __getattr__(name: str):
    if name == "ChdbStore":
        return _chdb_store_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
