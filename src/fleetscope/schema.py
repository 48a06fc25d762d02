"""Which columns each source's batches must carry, and their types.

Every event carries its identity (tenant, job, rank, pid, gpu) and its event
time `ts_ns` (ns since the Unix epoch), and where known its placement (pod,
namespace, container). The node is the batch's `host`.
Events that belong to the node rather than to a rank (host counters, agent
health) use tenant NODE_TENANT, job = the host name, rank -1.
"""
from __future__ import annotations

import numpy as np

from fleetscope.wire import Batch, StrColumn, WireError

NODE_TENANT = "_node"
NO_RANK = -1
NO_GPU = -1

STR = "str"
IDENTITY_COLUMNS = {"ts_ns": np.dtype("<i8"), "tenant": STR, "job": STR,
                    "rank": np.dtype("<i4"), "pid": np.dtype("<i4"), "gpu": np.dtype("<i2")}
# A metric sample: a gauge (interval_ns == 0) or a delta over interval_ns.
METRIC_COLUMNS = {"metric": STR, "device": STR, "value": np.dtype("<f8"), "interval_ns": np.dtype("<i8")}

SOURCE_COLUMNS: dict[str, dict] = {
    "host": {**IDENTITY_COLUMNS, **METRIC_COLUMNS},
    "agent": {**IDENTITY_COLUMNS, **METRIC_COLUMNS},
    # GPU telemetry: device metrics carry the node identity and the GPU index;
    # per-process metrics carry the process's resolved identity.
    "nvml": {**IDENTITY_COLUMNS, **METRIC_COLUMNS},
    "kernel": {**IDENTITY_COLUMNS, **METRIC_COLUMNS},
    # Per-process /proc counters (producers/process_sampler.py): the process's identity, device pid<N>.
    "proc": {**IDENTITY_COLUMNS, **METRIC_COLUMNS},
}
# Traced sources: uprobe/USDT tracers duty-cycle their probes under an
# overhead budget, so every row says what fraction of its interval the probe
# family was attached (1.0 = always on). Counts divide by it downstream.
TRACED_SOURCES = ("cuda", "nccl", "python", "torch", "python_sampler")
SAMPLE_FRAC = {"sample_frac": np.dtype("<f8")}
SOURCE_COLUMNS.update({src: {**IDENTITY_COLUMNS, **METRIC_COLUMNS, **SAMPLE_FRAC} for src in TRACED_SOURCES})
# Where a process runs, where known (producers/identity.py Identity.placement): its Kubernetes pod (name, else
# the UID its cgroup names), the pod's namespace, and its container (name, else the short container id).
# Optional: node rows and sources that see no process leave them out, and the store fills ''.
PLACEMENT_COLUMNS = {"pod": STR, "namespace": STR, "container": STR}
# Columns any source may carry, which the worker and the sink read when present: typed like the required
# ones, so a mistyped one is refused once, at decode, instead of failing later in the worker and the sink.
OPTIONAL_COLUMNS = {**SAMPLE_FRAC, **PLACEMENT_COLUMNS}


def validate(batch: Batch) -> None:
    """Raise WireError unless the batch has its source's columns, and those and any optional ones typed right."""
    spec = SOURCE_COLUMNS.get(batch.source)
    if spec is None:
        raise WireError(f"unknown source {batch.source!r}; known: {sorted(SOURCE_COLUMNS)}")
    for name, kind in {**OPTIONAL_COLUMNS, **spec}.items():
        col = batch.columns.get(name)
        if col is None:
            if name in spec:
                raise WireError(f"{batch.source} batch lacks column {name!r}")
            continue
        if kind == STR:
            if not isinstance(col, StrColumn):
                raise WireError(f"{batch.source} column {name!r} must be a string column")
        elif isinstance(col, StrColumn) or col.dtype != kind:
            got = "str" if isinstance(col, StrColumn) else col.dtype
            raise WireError(f"{batch.source} column {name!r} must be {kind}, got {got}")


def node_identity(host: str, n: int) -> dict:
    """Identity columns for n node-level events (no rank, no process)."""
    return {"tenant": StrColumn.constant(NODE_TENANT, n), "job": StrColumn.constant(host, n),
            "rank": np.full(n, NO_RANK, dtype="<i4"), "pid": np.zeros(n, dtype="<i4"),
            "gpu": np.full(n, NO_GPU, dtype="<i2")}
