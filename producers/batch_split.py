"""Cutting batches into messages: one per (tenant, job) key, each under the broker's size limit."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fleetscope.wire import Batch, StrColumn


def _take_strings(col: StrColumn, rows) -> StrColumn:
    # Only the strings these rows use: a part must not carry its siblings' (possibly huge) values.
    codes = col.codes[rows]
    used, remapped = np.unique(codes, return_inverse=True)
    if len(used) == len(col.values):
        return StrColumn(codes, col.values)
    return StrColumn(remapped.astype(np.uint32), tuple(col.values[int(i)] for i in used))


def take_rows(batch: Batch, rows, suffix: str) -> Batch:
    """The batch restricted to `rows` (indexes or a slice), with its own batch id."""
    cols = {n: (_take_strings(c, rows) if isinstance(c, StrColumn) else c[rows]) for n, c in batch.columns.items()}
    return Batch(batch.source, batch.host, cols, batch_id=f"{batch.batch_id}-{suffix}",
                 created_ns=batch.created_ns, extras=batch.extras)


def split_by_job(batch: Batch) -> list[tuple[str, Batch]]:
    """One message per (tenant, job), so that the key `tenant/job` is exact."""
    tenant, job = batch.columns["tenant"], batch.columns["job"]
    pair = tenant.codes.astype(np.uint64) << np.uint64(32) | job.codes.astype(np.uint64)
    uniq = np.unique(pair)

    def key(p) -> str:
        return f"{tenant.values[int(p >> np.uint64(32))]}/{job.values[int(p & np.uint64(0xFFFFFFFF))]}"

    if len(uniq) == 1:
        return [(key(uniq[0]), batch)]
    return [(key(p), take_rows(batch, np.nonzero(pair == p)[0], str(i))) for i, p in enumerate(uniq)]


def encode_to_fit(batch: Batch, limit: int, encode: Callable[[Batch], bytes]) -> tuple[list[tuple[Batch, bytes]], int]:
    """Encoded parts of `batch`, each at most `limit` bytes, in row order, and the number of rows dropped.

    A batch over the limit is halved until its parts fit; a single row that
    still does not fit cannot be sent at all, so it is dropped (the caller
    counts it) rather than failing every later batch behind it.
    """
    value = encode(batch)
    if len(value) <= limit:
        return [(batch, value)], 0
    if batch.count <= 1:
        return [], batch.count
    half = batch.count // 2
    first, dropped_first = encode_to_fit(take_rows(batch, slice(0, half), "a"), limit, encode)
    second, dropped_second = encode_to_fit(take_rows(batch, slice(half, batch.count), "b"), limit, encode)
    return first + second, dropped_first + dropped_second
