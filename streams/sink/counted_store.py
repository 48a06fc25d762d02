"""The sink's store, counted at its door: rows stored and inserts per table, the inserts the store refused,
and how long each took.

Everything the sink stores goes through `store.insert` (store_writes.Insert runs each piece there), so
counting there sees every table, the raw rows as the derived ones and the dead letters, without a hook in
the sink's loop. A retried insert the store drops by its dedupe token still reports its rows (base.Store's
contract: "those rows are stored"), so rows stored counts a replayed poll again.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram


class CountedStore:
    """Delegates to `store`; `insert` is counted. The sink's tables are a fixed set: `table` is a bounded label."""

    def __init__(self, store, registry: CollectorRegistry):
        self.inner = store
        self.rows = Counter("fleetscope_sink_rows_stored", "rows the store took, by table (a retry the store "
                            "drops by its dedupe token counts again)", ["table"], registry=registry)
        self.inserts = Counter("fleetscope_sink_inserts", "INSERT statements the store took, by table", ["table"],
                               registry=registry)
        self.failures = Counter("fleetscope_sink_insert_failures", "INSERT statements that raised (store down, or "
                                "data it refused; store_writes retries, bisects, then dead-letters)", ["table"],
                                registry=registry)
        self.seconds = Histogram("fleetscope_sink_insert_seconds", "time one INSERT takes, failed ones included",
                                 registry=registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))

    def insert(self, table: str, columns, dedupe_token: str | None = None) -> int:
        start = time.perf_counter()
        try:
            n = self.inner.insert(table, columns, dedupe_token=dedupe_token)
        except Exception:
            self.failures.labels(table).inc()
            raise
        finally:
            self.seconds.observe(time.perf_counter() - start)
        self.inserts.labels(table).inc()
        self.rows.labels(table).inc(n or 0)
        return n

    def __getattr__(self, name: str):  # query, migrate, close, ...: the store's own
        return getattr(self.inner, name)
