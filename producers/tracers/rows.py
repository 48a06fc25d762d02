"""What every tracer shares when it turns counters into a Batch: the identity
of a pid (through the resolver, else the node's), deltas of cumulative
counters, and the columnar batch of metric rows for a source.

A row is (metric, device, value, pid), or (metric, device, value, pid,
interval_ns, sample_frac) when it differs from the batch's interval (gauges
carry interval_ns 0) or from full sampling. Sources whose schema has no
sample_frac column simply do not get one.

Identity and placement columns are built per process, not per row: a tick
has a handful of pids and thousands of rows, so each string column is a
dictionary of the processes' values indexed by each row's process.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np

from fleetscope.schema import NO_GPU, NO_RANK, NODE_TENANT, PLACEMENT_COLUMNS, SOURCE_COLUMNS
from fleetscope.wire import Batch, StrColumn

log = logging.getLogger(__name__)

NO_PLACEMENT = ("", "", "")


class RowIdentity(NamedTuple):
    """Who a process's rows belong to, and where it runs (pod, namespace, container: Identity.placement())."""

    tenant: str
    job: str
    rank: int
    gpu: int
    placement: tuple[str, str, str] = NO_PLACEMENT


def identity(resolver, host: str, pid: int) -> RowIdentity:
    """The resolver's answer (cached per pid by the resolver), else the node's, which has no placement."""
    ident = None
    if pid and resolver is not None:
        try:
            ident = resolver.resolve(pid)
        except Exception:  # a process can exit mid-resolution; its rows still count
            log.debug("identity of pid %d not resolved", pid, exc_info=True)
    if ident is None:
        return RowIdentity(NODE_TENANT, host, NO_RANK, NO_GPU)
    gpu = getattr(ident, "gpu", NO_GPU)
    placement = getattr(ident, "placement", None)  # resolvers other than IdentityResolver may not know it
    return RowIdentity(ident.tenant or NODE_TENANT, ident.job or host,
                       NO_RANK if ident.rank is None else int(ident.rank), NO_GPU if gpu is None else int(gpu),
                       placement() if placement is not None else NO_PLACEMENT)


class LastKnownIdentities:
    """Per pid, the last identity the resolver gave other than the node's, which `resolve` answers once the
    resolver has none any more (the process ended, or is a zombie whose /proc no longer says). An entry goes
    with forget(pid), or with expire() once not resolved for a while."""

    def __init__(self, resolver, host: str):
        self.resolver, self.host = resolver, host
        self.node = identity(None, host, 0)  # what a pid gets when the resolver never knew it
        self._last: dict[int, tuple[RowIdentity, int]] = {}  # pid -> (identity, when last resolved)

    def resolve(self, pid: int, now_ns: int = 0) -> RowIdentity:
        ident = identity(self.resolver, self.host, pid)
        if ident != self.node:
            self._last[pid] = (ident, now_ns)
            return ident
        last = self._last.get(pid)
        return last[0] if last is not None else ident

    def forget(self, pid: int) -> RowIdentity | None:
        last = self._last.pop(pid, None)
        return last[0] if last is not None else None

    def expire(self, before_ns: int) -> None:
        """Forget every pid last resolved before `before_ns`."""
        self._last = {pid: last for pid, last in self._last.items() if last[1] >= before_ns}

    def known(self) -> list[RowIdentity]:
        return [last[0] for last in list(self._last.values())]


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


def per_process(values: list[str], process_of_row: np.ndarray) -> StrColumn:
    """A string column from one value per process: a dictionary of the distinct values, then each row's
    process's code (no Python string per row)."""
    index: dict[str, int] = {}
    codes = np.fromiter((index.setdefault(v, len(index)) for v in values), dtype=np.uint32, count=len(values))
    return StrColumn(codes[process_of_row], tuple(index))


def metric_batch(source: str, host: str, rows: list[tuple], now_ns: int, interval: int, identity_of) -> Batch:
    """One Batch of `rows` for `source`; `identity_of(pid)` (a RowIdentity) is called once per distinct pid.

    The placement columns (pod, namespace, container) are added when some process of the batch has one;
    a batch of node rows, or of processes outside any pod or container, leaves them out (the store reads '')."""
    n = len(rows)
    full = [r if len(r) == 6 else (*r, interval, 1.0) for r in rows]
    metrics, devices, values, pids, intervals, fracs = zip(*full)
    pid_of_row = np.array(pids, dtype="<i4")
    distinct, process_of_row = np.unique(pid_of_row, return_inverse=True)
    idents = [identity_of(int(pid)) for pid in distinct.tolist()]  # one resolve per process per tick
    columns = {"ts_ns": np.full(n, now_ns, dtype="<i8"),
               "tenant": per_process([i.tenant for i in idents], process_of_row),
               "job": per_process([i.job for i in idents], process_of_row),
               "rank": np.array([i.rank for i in idents], dtype="<i4")[process_of_row],
               "pid": pid_of_row, "gpu": np.array([i.gpu for i in idents], dtype="<i2")[process_of_row],
               "metric": StrColumn.of(metrics), "device": StrColumn.of(devices),
               "value": np.array(values, dtype="<f8"), "interval_ns": np.array(intervals, dtype="<i8"),
               "sample_frac": np.array(fracs, dtype="<f8")}
    batch_columns = {name: columns[name] for name in SOURCE_COLUMNS[source]}
    placements = [i.placement for i in idents]
    if any(p != NO_PLACEMENT for p in placements):
        for k, name in enumerate(PLACEMENT_COLUMNS):
            batch_columns[name] = per_process([p[k] for p in placements], process_of_row)
    return Batch(source=source, host=host, created_ns=now_ns, columns=batch_columns)
