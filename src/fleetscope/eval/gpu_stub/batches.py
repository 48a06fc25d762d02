"""Read a tracer's Batch as a consumer would: validate, round-trip the wire codec, index the rows."""
from __future__ import annotations

from fleetscope import wire
from fleetscope.schema import validate


def rows(batch) -> list[dict]:
    validate(batch)
    back = wire.decode(wire.encode(batch))
    validate(back)
    cols = {k: (v.to_numpy() if isinstance(v, wire.StrColumn) else v) for k, v in back.columns.items()}
    return [{k: cols[k][i] for k in cols} for i in range(back.count)]


def index(batches, pid: int | None = None) -> dict[tuple[str, str], float]:
    """(metric, device) -> value summed over batches (deltas) or the last value (gauges, interval_ns 0)."""
    out: dict[tuple[str, str], float] = {}
    for b in batches:
        for r in rows(b) if b is not None else []:
            if pid is not None and r["pid"] not in (pid, 0):
                continue
            key = (str(r["metric"]), str(r["device"]))
            out[key] = float(r["value"]) if r["interval_ns"] == 0 else out.get(key, 0.0) + float(r["value"])
    return out
