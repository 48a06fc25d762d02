"""A host's metric batches and a StreamProcessor on the real chDB store with a fake wall clock, shared by the
processor's tests."""
import time

import numpy as np

from fleetscope.config import Config
from fleetscope.schema import node_identity
from fleetscope.wire import Batch, StrColumn
from fleetscope.streams.processor import StreamProcessor

SEC = 10**9
HOUR = 3600 * SEC
T0 = (time.time_ns() // HOUR - 2) * HOUR  # event times must lie within retention and the future skew bound


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def host_batch(ts_ns: int, busy_s: float, idle_s: float, host="node-a") -> Batch:
    names = ["cpu.user", "cpu.nice", "cpu.system", "cpu.idle", "cpu.iowait", "cpu.irq", "cpu.softirq", "cpu.steal",
             "mem.total", "mem.available"]
    vals = [busy_s, 0, 0, idle_s, 0, 0, 0, 0, 1000.0, 250.0]
    n = len(names)
    cols = {"ts_ns": np.full(n, ts_ns, dtype="<i8"), **node_identity(host, n),
            "metric": StrColumn(np.arange(n, dtype=np.uint32), tuple(names)),
            "device": StrColumn.constant("all", n), "value": np.array(vals, dtype="<f8"),
            "interval_ns": np.array([SEC // 2] * 8 + [0, 0], dtype="<i8")}
    return Batch("host", host, cols)


def make_processor(store, clock, tmp_path):
    cfg = Config(data_dir=tmp_path, window_s=1.0, allowed_lateness_s=0.5, idle_close_s=30)
    return StreamProcessor(cfg, store, producer=None, clock=clock)
