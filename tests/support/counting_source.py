"""A source as a third party would write one: this module plus one line in the source registry.

It publishes one `host` row per tick (metric "test.tick", value = the tick's number) and reports how
many ticks it saw in the agent's health events, so a test can find both downstream.
"""
from __future__ import annotations

import numpy as np

from fleetscope.schema import node_identity
from fleetscope.wire import Batch, StrColumn

BUILT: list["CountingSource"] = []  # what build_source made, for the test to inspect after the agent ran


class CountingSource:
    name = "counting"

    def __init__(self, host: str):
        self.host = host
        self.ticks = 0
        self.closed = False

    def sample(self, now_ns: int) -> Batch:
        self.ticks += 1
        cols = {"ts_ns": np.array([now_ns], dtype="<i8"), **node_identity(self.host, 1),
                "metric": StrColumn.constant("test.tick", 1), "device": StrColumn.constant("all", 1),
                "value": np.array([float(self.ticks)], dtype="<f8"), "interval_ns": np.zeros(1, dtype="<i8")}
        return Batch("host", self.host, cols, created_ns=now_ns)

    def stats(self) -> dict:
        return {"counting_ticks": self.ticks}

    def close(self) -> None:
        self.closed = True


def build_source(cfg, new_resolver, publish) -> CountingSource:
    BUILT.append(CountingSource(cfg.host))
    return BUILT[-1]
