"""Slow drifts of memory held, told from steps: a leak is diagnosed as a leak.

A rank that leaks device memory (or host memory) 1 MiB per step moves its
``cuda_mem_live_bytes`` (``proc_rss_bytes``) a little every window. No single
window is far out, and the mixture flags it late, once the level is far from
anything learned, when the KB can only read "this rank differs" (a straggler).

Per rank and feature, river's ADWIN watches the level. A change it detects is
a drift when the level has grown in most of the last ``span`` windows (a
step, such as a new model phase allocating once, grows in one window); the
rank is then flagged (detector ``drift``) with the growth rate,
``cuda_mem_growth_bytes_per_s`` or ``proc_rss_growth_bytes_per_s`` (least
squares over the span), for as long as the level keeps growing. The growth
must also exceed ``min_growth`` bytes over the span (allocator noise is not a
leak), and have gone on for ``min_duration_s`` seconds (at short windows a
span of 8 is a few seconds: a burst of allocation is not a leak).

Start-up is not a leak: a process that starts grows its RSS while it imports
and builds its model (torch's warm-up: measured on the CI gloo job, RSS grew
in most of its first windows and ranks 1 and 2 were flagged drifting). Each
series' first ``warmup`` levels (the job model's warm-up, counted per rank so
a rank that joins late or restarts gets its own) are not judged: ADWIN sees
them (a change it finds there drops the start-up from its window, and a flat
reference after the start-up lets it see a leak as soon as before) but a
change found in them is not a drift. While a rank drifts, the job model learns nothing from it and its
thresholds do not move (streams/model/job_model.py ``hold``).

Checkpointed with the job's model (a checkpoint part, model/checkpoint.py):
each series' last ``span`` levels and whether it is in a change are saved
exactly. ADWIN's own state (river's, in Rust) cannot be read out, so its last
``REPLAY`` levels are saved and replayed into a fresh ADWIN on restore: the
restored detector holds those levels, not an older part of a longer window,
so a change building up over more than REPLAY windows before the restart is
seen later than it would have been.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
from river.drift import ADWIN

from fleetscope.streams.model.checkpoint import JobPart

DRIFT_FEATURES = (("cuda_mem_live_bytes", "cuda_mem_growth_bytes_per_s"),
                  ("proc_rss_bytes", "proc_rss_growth_bytes_per_s"))
DRIFT_NAMES = tuple(name for name, _ in DRIFT_FEATURES)
REPLAY = 64    # levels kept per series to rebuild its ADWIN after a restart


@dataclass
class DriftFlag:
    index: int                    # the step row
    features: dict[str, float]    # <feature>_growth_bytes_per_s of each drifting feature


class _Series:
    def __init__(self, span: int):
        self.values: deque[tuple[float, float]] = deque(maxlen=span)   # (seconds, value)
        self.adwin = new_adwin()
        self.recent: deque[float] = deque(maxlen=REPLAY)   # what ADWIN was fed last: replayed on restore
        self.changed = False    # ADWIN saw a change and the level is still growing
        self.seen = 0           # levels observed, start-up included
        self.growing_since: float | None = None   # the span's start when it first read as a drift


def new_adwin() -> ADWIN:
    return ADWIN(delta=0.002, grace_period=5, min_window_length=3, clock=1)


class MemoryDrift:
    def __init__(self, span: int = 8, grow_share: float = 0.75, min_growth: float = 8 * 2**20,
                 capacity: int = 100_000, warmup: int = 30, min_duration_s: float = 5.0):
        self.span = span
        self.warmup = warmup                  # levels of each series skipped: the process's start-up
        self.min_duration_s = min_duration_s  # a drift grows at least this long before it is flagged
        self.grow_share = grow_share
        self.min_growth = min_growth
        self.capacity = capacity
        self.series: dict[tuple, _Series] = {}
        self.counts = {"changes": 0, "drifting_rows": 0}

    def part(self, job: tuple[str, str]) -> JobPart:
        return JobPart(self, job)

    def state(self, job: tuple[str, str]) -> tuple[dict, dict[str, np.ndarray]]:
        """The job's series: hosts in the meta, everything else as arrays, one row per series."""
        keys = [k for k in self.series if k[:2] == job]
        rows = [self.series[k] for k in keys]
        meta = {"hosts": [k[2] for k in keys]}
        n = len(keys)
        values = np.full((n, self.span, 2), np.nan)
        recent = np.full((n, REPLAY), np.nan)
        for i, s in enumerate(rows):
            if s.values:
                values[i, :len(s.values)] = np.array(s.values)
            recent[i, :len(s.recent)] = np.array(s.recent)
        return meta, {"rank": np.array([k[3] for k in keys], dtype=np.int64),
                      "feature": np.array([DRIFT_NAMES.index(k[4]) for k in keys], dtype=np.int64),
                      "changed": np.array([s.changed for s in rows], dtype=np.bool_),
                      "values": values, "recent": recent}

    def load(self, job: tuple[str, str], meta: dict, arrays) -> None:
        hosts = meta.get("hosts") if isinstance(meta, dict) else None
        if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
            arrays.fail("hosts: not a list of host names")
        n = len(hosts)
        ranks = arrays.take("rank", "i8", (n,))
        features = arrays.take("feature", "i8", (n,))
        changed = arrays.take("changed", "b1", (n,))
        values = arrays.take("values", "f8", (n, self.span, 2))
        recent = arrays.take("recent", "f8", (n, REPLAY))
        if ((features < 0) | (features >= len(DRIFT_NAMES))).any():
            arrays.fail("feature: an index outside the drift features")
        for k in [k for k in self.series if k[:2] == job]:
            del self.series[k]
        for i, host in enumerate(hosts):
            s = _Series(self.span)
            # every level is fed to ADWIN, so the levels it held count the series' levels (a full REPLAY: at
            # least that many, taken as past a warm-up longer than REPLAY too)
            held = int((~np.isnan(recent[i])).sum())
            s.seen = held if held < REPLAY else max(held, self.warmup)
            kept = values[i][~np.isnan(values[i]).any(axis=1)]
            s.values.extend((float(t), float(x)) for t, x in kept)
            for x in recent[i][~np.isnan(recent[i])].tolist():
                s.adwin.update(x)
                s.recent.append(x)
            s.changed = bool(changed[i])
            self.series[(*job, host, int(ranks[i]), DRIFT_NAMES[int(features[i])])] = s

    def step(self, job: tuple[str, str], start_ns: int, members: Sequence[tuple[str, int]],
             vectors: Sequence[Mapping[str, float]]) -> list[DriftFlag]:
        flags = []
        t = start_ns / 1e9
        for i, ((host, rank), v) in enumerate(zip(members, vectors)):
            out = {}
            for name, growth_name in DRIFT_FEATURES:
                x = v.get(name)
                if x is None or not math.isfinite(float(x)):
                    continue
                growth = self._observe((*job, host, rank, name), t, float(x))
                if growth is not None:
                    out[growth_name] = growth
            if out:
                flags.append(DriftFlag(i, out))
        self.counts["drifting_rows"] += len(flags)
        return flags

    def _observe(self, key: tuple, t: float, x: float) -> float | None:
        s = self.series.get(key)
        if s is None:
            if len(self.series) >= self.capacity:
                self.series.pop(next(iter(self.series)))
            s = self.series[key] = _Series(self.span)
        if s.values and t <= s.values[-1][0]:
            return None            # a late or replayed window
        s.seen += 1
        s.recent.append(x)
        s.adwin.update(x)
        if s.seen <= self.warmup:   # start-up growth: ADWIN's changes in it are not judged (it sheds them)
            s.values.clear()
            s.values.append((t, x))
            return None
        s.values.append((t, x))
        if s.adwin.drift_detected and not s.changed:
            s.changed = True
            self.counts["changes"] += 1
        if not s.changed or len(s.values) < s.values.maxlen:
            return None
        xs = [v for _, v in s.values]
        ups = sum(b > a for a, b in zip(xs, xs[1:]))
        if ups < self.grow_share * (len(xs) - 1) or xs[-1] - xs[0] < self.min_growth:
            s.changed = ups >= self.grow_share * (len(xs) - 1)   # a step: done; a slowing drift: still watched
            s.growing_since = None
            return None
        if s.growing_since is None:
            s.growing_since = s.values[0][0]
        if t - s.growing_since < self.min_duration_s:
            return None            # not yet sustained
        return _slope(s.values)


def _slope(points) -> float:
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mx = sum(x for _, x in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (x - mx) for t, x in points) / var if var > 0 else 0.0
