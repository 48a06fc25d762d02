"""Test helpers shared by the tracer tests: a batch's rows as a consumer sees them, and a file wait."""
import os
import time

from fleetscope import wire
from fleetscope.schema import validate


def rows(batch):
    """Check the batch as a consumer would (validate, encode, decode), then return its rows as dicts."""
    validate(batch)
    back = wire.decode(wire.encode(batch))
    validate(back)
    cols = {k: (v.to_numpy() if isinstance(v, wire.StrColumn) else v) for k, v in back.columns.items()}
    return [{k: cols[k][i] for k in cols} for i in range(back.count)]


def values(batch_rows, metric, pid):
    """{device: value} of one metric of one pid."""
    return {r["device"]: r["value"] for r in batch_rows if r["metric"] == metric and r["pid"] == pid}


def wait_for(path, timeout=120):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


def stop_all(procs):
    """Kill and reap the workload processes a test started."""
    for p in procs:
        p.kill()
        p.wait(timeout=10)
