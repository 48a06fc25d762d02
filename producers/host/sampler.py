"""HostSampler: run the host collectors once and pack their samples into one batch (the agent's `host` source)."""
from __future__ import annotations

import logging
import time

import numpy as np

from fleetscope.schema import SOURCE_COLUMNS
from fleetscope.wire import Batch
from fleetscope.producers.host.collector import Collector, Sample, build_collectors, load_builtin_collectors
from fleetscope.producers.host.columns import BatchIds, NodeIdentityColumns, RepeatingColumn

log = logging.getLogger(__name__)

# Importing the sampler must make every collector available by name.
load_builtin_collectors()


# A collector with a cadence runs once at least 95% of it has passed since its
# last run, so tick jitter does not push a 1 s collector to every 11th 100 ms tick.
_DUE_SLACK = 0.95


class HostSampler:
    name = "host"

    def __init__(self, host: str, collectors: list[Collector], use_cadence: bool = True):
        self.host = host
        self.collectors = list(collectors)
        self.collector_errors: dict[str, int] = {}
        # use_cadence=False runs every collector every tick (Collector.cadence_ns ignored).
        self._cadence = [int(c.cadence_ns * _DUE_SLACK) if use_cadence else 0 for c in self.collectors]
        self._last_run: list[int | None] = [None] * len(self.collectors)
        # Built once per layout of rows (see columns.py).
        self._identity = NodeIdentityColumns(host)
        self._metric_column = RepeatingColumn()
        self._device_column = RepeatingColumn()
        self._batch_id = BatchIds()

    def sample(self, now_ns: int | None = None) -> Batch | None:
        """One batch of every collector's samples at now_ns, or None if there are none."""
        now_ns = time.time_ns() if now_ns is None else int(now_ns)
        samples: list[Sample] = []
        last_run = self._last_run
        for i, collector in enumerate(self.collectors):
            last, cadence = last_run[i], self._cadence[i]
            if cadence and last is not None and now_ns - last < cadence:
                continue  # not due this tick
            last_run[i] = now_ns
            try:
                samples += collector.collect(now_ns)
            except Exception:  # one broken collector must not silence the others
                self.collector_errors[collector.name] = self.collector_errors.get(collector.name, 0) + 1
                log.exception("host collector %r failed; its samples are missing from this tick", collector.name)
        if not samples:
            return None
        n = len(samples)
        # Samples are tuples: one zip(*) splits them into the four columns.
        metrics, devices, values, intervals = zip(*samples)
        columns = self._identity(n)
        columns.update(ts_ns=np.full(n, now_ns, dtype="<i8"), metric=self._metric_column(metrics),
                       device=self._device_column(devices), value=np.array(values, dtype="<f8"),
                       interval_ns=np.array(intervals, dtype="<i8"))
        spec = SOURCE_COLUMNS["host"]
        # Emit columns in the schema's order, and fail loudly here (not in a
        # consumer) if the schema grows a column this sampler does not fill.
        return Batch(source="host", host=self.host, created_ns=now_ns, batch_id=self._batch_id(),
                     columns={name: columns[name] for name in spec})

    def stats(self) -> dict:
        return {}  # collector failures are logged with their traceback (collector_errors keeps the counts)

    def close(self) -> None:
        for collector in self.collectors:
            collector.close()


def build_source(cfg, new_resolver, publish) -> HostSampler:
    """The agent's host source: the collectors `collectors` names, or every default-enabled one."""
    return HostSampler(cfg.host, build_collectors(list(cfg.collectors) if cfg.collectors else None))

