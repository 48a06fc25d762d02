"""What the two SQL backends (chDB, ClickHouse server) share: migrations and table types.

Its own module so that base.py (the interface) and migrations.py (which uses
the interface) need no import of each other.
"""
from __future__ import annotations

from fleetscope.store import migrations
from fleetscope.store.base import Prepared, Store, StoreError, check_identifier, prepare_columns


class SqlStore(Store):
    """What the chDB and server backends share: migrations and table types."""

    def __init__(self, database: str, ttl_days: int) -> None:
        self.database = check_identifier(database, "database")
        self.ttl_days = ttl_days
        self._types: dict[str, dict[str, str]] = {}

    def migrate(self) -> list[str]:
        applied = migrations.apply(self, self.database, self.ttl_days)
        self._types.clear()  # a migration may have changed a table
        return applied

    def column_types(self, table: str) -> dict[str, str]:
        check_identifier(table, "table name")
        if table not in self._types:
            res = self.query("SELECT name, type FROM system.columns WHERE database = {db:String} "
                             "AND table = {t:String} ORDER BY position", {"db": self.database, "t": table})
            if not res.rows:
                raise StoreError(f"table {self.database}.{table} does not exist; run `fleetscope db migrate`")
            self._types[table] = {name: typ for name, typ in res.rows}
        return self._types[table]

    def prepare_insert(self, table: str, columns, dedupe_token: str | None) -> tuple[list[Prepared], int]:
        """Validate the table name and token; shape the columns for this table's types."""
        check_identifier(table, "table name")
        self.check_token(dedupe_token)
        return prepare_columns(table, columns, self.column_types(table))

    @staticmethod
    def check_token(token: str | None) -> None:
        if token is not None and (not isinstance(token, str) or not token):
            raise StoreError("dedupe_token must be a non-empty string or None")
