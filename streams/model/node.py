"""Node-level scoring: what a node's own window says about every rank on it.

Each node window (tenant ``_node``, job = host: host counters, device-level
NVML, the kernel tracer's per-CPU IRQs) is scored by a JobModel of its own,
one row per window, with the same online mixture and DSPOT thresholds as the
jobs (streams/scoring.py keeps one per host, checkpointed like a job's). Its
reference is the node's own past: a node has no peers in its window.

A flagged node window becomes a NodeFlag; the scorer attributes it to every
rank of that host in the same window with role ``node``. The flag carries the
node features' z against the node's history (the model's standardization),
which a node anomaly's ``peer_z`` holds in place of a comparison across ranks,
so KB rules such as ``peer_z: cpu_busy_frac >= 3`` read "far above what this
node usually does".
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Mapping

import numpy as np

from fleetscope.streams.gpu_features import FAULT_FEATURES

# Not model inputs: faults are loud failures (model/loud.py), and the agent's own counters describe the
# agent, not the node's health.
NOT_SCORED = frozenset(FAULT_FEATURES) | frozenset(("agent_dropped_events", "agent_delivery_errors",
                                                    "agent_spooled"))
NODE_ROW = -1          # the rank a node window's row carries (schema: node rows have rank -1)
FLAG_CACHE = 20_000    # (host, window) node flags kept for attribution


def node_model_config(job_config):
    """The jobs' model settings, with a warm-up long enough for one row per window: a feature is
    standardized after ``scaler_min_obs`` rows, the scored set is fixed halfway through warm-up, and
    DSPOT calibrates on the second half's scores (at least 10)."""
    need = 2 * max(job_config.scaler_min_obs + 1, 10)
    return replace(job_config, warmup_windows=max(job_config.warmup_windows, need))


def node_model_input(vector: Mapping[str, float]) -> dict[str, float]:
    """The node window's features the node model scores."""
    return {k: v for k, v in vector.items() if k not in NOT_SCORED}


@dataclass
class NodeFlag:
    score: float
    threshold: float | None
    contributions: dict[str, float] = field(default_factory=dict)
    history_z: dict[str, float] = field(default_factory=dict)


class NodeFlags:
    """Flagged node windows, by (host, window start), until the ranks of that window are scored."""

    def __init__(self, capacity: int = FLAG_CACHE):
        self.capacity = capacity
        self.flags: OrderedDict[tuple[str, int], NodeFlag] = OrderedDict()
        self.attributed: set[tuple[str, int]] = set()

    def add(self, host: str, start_ns: int, flag: NodeFlag) -> None:
        self.flags[(host, start_ns)] = flag
        while len(self.flags) > self.capacity:
            old, _ = self.flags.popitem(last=False)
            self.attributed.discard(old)

    def get(self, host: str, start_ns: int) -> NodeFlag | None:
        flag = self.flags.get((host, start_ns))
        if flag is not None:
            self.attributed.add((host, start_ns))
        return flag


def history_z(model, vector: Mapping[str, float], top: int = 8) -> dict[str, float]:
    """The vector's features standardized against what ``model`` learned of them (only features with
    enough history); the ``top`` largest in magnitude."""
    index, scaler = model.index, model.scaler
    out = {}
    ready = scaler.ready()
    scale = scaler.scale()
    for name, value in vector.items():
        j = index.index.get(name)
        if j is None or j >= ready.size or not ready[j]:
            continue
        x = float(value)
        if not math.isfinite(x):
            continue
        z = (x - float(scaler.mean[j])) / float(scale[j])
        if z:
            out[name] = float(np.clip(z, -scaler.clip, scaler.clip))
    return dict(sorted(out.items(), key=lambda kv: -abs(kv[1]))[:top])
