"""A rank's metric rows as one raw batch, as a tracer or the process sampler sends it (validated)."""
from __future__ import annotations

import numpy as np

from fleetscope.schema import SOURCE_COLUMNS, validate
from fleetscope.wire import Batch, StrColumn


def rank_batch(source: str, host: str, tenant: str, job: str, rank: int, gpu: int, ts: int, rows) -> Batch:
    """`rows`: (metric, device, value, interval_ns); pid 1000 + rank."""
    n = len(rows)
    metric, device, value, interval = zip(*rows)
    cols = {"ts_ns": np.full(n, ts, "<i8"), "tenant": StrColumn.constant(tenant, n),
            "job": StrColumn.constant(job, n), "rank": np.full(n, rank, "<i4"),
            "pid": np.full(n, 1000 + rank, "<i4"), "gpu": np.full(n, gpu, "<i2"),
            "metric": StrColumn.of(metric), "device": StrColumn.of(device), "value": np.array(value, "<f8"),
            "interval_ns": np.array(interval, "<i8"), "sample_frac": np.ones(n, "<f8")}
    batch = Batch(source, host, {k: cols[k] for k in SOURCE_COLUMNS[source] if k in cols}, created_ns=ts)
    validate(batch)
    return batch
