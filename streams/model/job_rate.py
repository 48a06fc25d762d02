"""A job against its own history: the job-wide collective rate and the iteration time it implies.

Peer comparison cannot see a job that slows down as a whole (a competing
process that every rank feels alike): no rank differs from the others. The
job's own past can. Per job step:

- the job's collective rate is the median over its ranks of the completed
  collective calls per second: ``nccl_calls_per_s`` for NCCL jobs,
  ``torch_comm_waits_per_s`` (gloo waits) for CPU jobs, whichever at least
  half the ranks report;
- iteration time. A training step issues the same collectives every
  iteration, so the collective rate is (calls per iteration) / (iteration
  time). The windows carry per-window counts, not call timestamps, so the
  period cannot be read off the call cadence inside a window (Greyhound's
  method needs the per-call times); what they do give is the iteration time
  relative to the job's own baseline: ``job_iteration_time_ratio`` =
  baseline rate / current rate (1.25: iterations take 25% longer);
- a change is a step or a drift. A step: the rate is ``z_enter`` robust
  deviations from the healthy history's median, flagged in the window it
  happens. A drift: river's Page-Hinkley test on the rate relative to the
  baseline, which accumulates small shifts that no single window shows, and
  flags once the rate is also ``z_exit`` deviations away;
- while a change lasts the history is frozen (the slowdown is not learned as
  normal); it ends when the rate is back within ``z_exit`` deviations. After
  ``regime_windows`` flagged windows in a row the new rate is accepted as the
  job's new normal (as JobModel does for a new phase).

Windows in which no rank completed a collective are left out (a hang is
model/loud.py's). Not checkpointed: a restarted worker relearns the baseline
in ``warmup`` windows.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Mapping, Sequence

from river.drift import PageHinkley

RATE_FEATURES = ("nccl_calls_per_s", "torch_comm_waits_per_s")
MAD_TO_SIGMA = 1.4826
REL_FLOOR = 0.02     # the rate's scale is at least 2% of its level: healthy jobs vary by a few percent


@dataclass
class JobRateResult:
    flagged: bool
    features: dict[str, float]     # job_collective_rate, job_rate_z, job_iteration_time_ratio
    rate_feature: str


class _JobRateState:
    def __init__(self, history: int, ph_threshold: float):
        self.history: deque[float] = deque(maxlen=history)
        self.ph = PageHinkley(min_instances=5, delta=0.01, threshold=ph_threshold)
        self.in_change = 0


class JobRates:
    def __init__(self, warmup: int = 10, z_enter: float = 6.0, z_exit: float = 3.0, history: int = 60,
                 regime_windows: int = 20, ph_threshold: float = 0.5):
        self.warmup = warmup
        self.z_enter = z_enter
        self.z_exit = z_exit
        self.history_len = history
        self.regime_windows = regime_windows
        self.ph_threshold = ph_threshold
        self.jobs: dict[tuple[str, str], _JobRateState] = {}
        self.newest: dict[tuple[str, str], int] = {}
        self.counts = {"windows": 0, "flagged": 0, "drifts": 0, "regimes": 0}

    def forget(self, job: tuple[str, str]) -> None:
        self.jobs.pop(job, None)
        self.newest.pop(job, None)

    def step(self, job: tuple[str, str], start_ns: int,
             vectors: Sequence[Mapping[str, float]]) -> JobRateResult | None:
        """Judge one job step; None when it carries no collective rate (or is late or replayed)."""
        if start_ns <= self.newest.get(job, -1):
            return None
        self.newest[job] = start_ns
        name, rate = job_rate(vectors)
        if name is None or rate <= 0:
            return None
        st = self.jobs.setdefault(job, _JobRateState(self.history_len, self.ph_threshold))
        self.counts["windows"] += 1
        if len(st.history) < self.warmup:
            st.history.append(rate)
            st.ph.update(1.0)
            return JobRateResult(False, {"job_collective_rate": rate}, name)
        base, scale = _median_scale(st.history)
        z = (rate - base) / scale
        st.ph.update(rate / base)
        drift = st.ph.drift_detected
        self.counts["drifts"] += drift
        if st.in_change:
            flagged = abs(z) >= self.z_exit
        else:
            flagged = abs(z) >= self.z_enter or (drift and abs(z) >= self.z_exit)
        if flagged:
            st.in_change += 1
            if st.in_change > self.regime_windows:   # the job's new normal: relearn from here
                st.history.clear()
                st.history.append(rate)
                st.ph = PageHinkley(min_instances=5, delta=0.01, threshold=self.ph_threshold)
                st.in_change = 0
                flagged = False
                self.counts["regimes"] += 1
        else:
            st.in_change = 0
            st.history.append(rate)
        self.counts["flagged"] += flagged
        return JobRateResult(flagged, {"job_collective_rate": rate, "job_rate_z": z,
                                       "job_iteration_time_ratio": base / rate}, name)


def job_rate(vectors: Sequence[Mapping[str, float]]) -> tuple[str | None, float]:
    """The first of RATE_FEATURES that at least half the ranks report, and its median over them."""
    for name in RATE_FEATURES:
        values = sorted(float(v[name]) for v in vectors if name in v and math.isfinite(float(v[name])))
        if values and 2 * len(values) >= len(vectors):
            return name, _median(values)
    return None, 0.0


def _median_scale(values) -> tuple[float, float]:
    xs = sorted(values)
    med = _median(xs)
    mad = _median(sorted(abs(x - med) for x in xs))
    return med, max(MAD_TO_SIGMA * mad, REL_FLOOR * abs(med), 1e-9)


def _median(xs: list[float]) -> float:
    n = len(xs)
    return 0.5 * (xs[(n - 1) // 2] + xs[n // 2])
