"""What every tracer shares when it turns counters into a Batch: the identity
of a pid (through the resolver, else the node's), deltas of cumulative
counters, and the columnar batch of metric rows for a source.

A row is (metric, device, value, pid), or (metric, device, value, pid,
interval_ns, sample_frac) when it differs from the batch's interval (gauges
carry interval_ns 0) or from full sampling. Sources whose schema has no
sample_frac column simply do not get one.
"""
from __future__ import annotations

import logging

import numpy as np

from fleetscope.schema import NO_GPU, NO_RANK, NODE_TENANT, SOURCE_COLUMNS
from fleetscope.wire import Batch, StrColumn

log = logging.getLogger(__name__)


def identity(resolver, host: str, pid: int) -> tuple[str, str, int, int]:
    """(tenant, job, rank, gpu): the resolver's answer, else the node's."""
    ident = None
    if pid and resolver is not None:
        try:
            ident = resolver.resolve(pid)
        except Exception:  # a process can exit mid-resolution; its rows still count
            log.debug("identity of pid %d not resolved", pid, exc_info=True)
    if ident is None:
        return NODE_TENANT, host, NO_RANK, NO_GPU
    gpu = getattr(ident, "gpu", NO_GPU)
    return (ident.tenant or NODE_TENANT, ident.job or host,
            NO_RANK if ident.rank is None else int(ident.rank), NO_GPU if gpu is None else int(gpu))


def diff(prev: dict, current: dict) -> dict:
    """Positive increases of cumulative counters since `prev`, per key (a value that shrank was re-created:
    count it whole)."""
    out = {}
    for k, v in current.items():
        d = v - prev.get(k, 0)
        if d < 0:
            d = v
        if d > 0:
            out[k] = d
    return out


def metric_batch(source: str, host: str, rows: list[tuple], now_ns: int, interval: int, identity_of) -> Batch:
    """One Batch of `rows` for `source`; `identity_of(pid)` is called once per distinct pid."""
    n = len(rows)
    full = [r if len(r) == 6 else (*r, interval, 1.0) for r in rows]
    metrics, devices, values, pids, intervals, fracs = zip(*full)
    idents = {pid: identity_of(pid) for pid in set(pids)}  # one resolve per process per tick
    tenants, jobs, ranks, gpus = zip(*(idents[p] for p in pids))
    columns = {"ts_ns": np.full(n, now_ns, dtype="<i8"), "tenant": StrColumn.of(tenants),
               "job": StrColumn.of(jobs), "rank": np.array(ranks, dtype="<i4"),
               "pid": np.array(pids, dtype="<i4"), "gpu": np.array(gpus, dtype="<i2"),
               "metric": StrColumn.of(metrics), "device": StrColumn.of(devices),
               "value": np.array(values, dtype="<f8"), "interval_ns": np.array(intervals, dtype="<i8"),
               "sample_frac": np.array(fracs, dtype="<f8")}
    return Batch(source=source, host=host, created_ns=now_ns,
                 columns={name: columns[name] for name in SOURCE_COLUMNS[source]})
