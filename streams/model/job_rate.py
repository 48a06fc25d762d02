"""A job against its own history: the job-wide collective rate and the iteration time it implies.

Peer comparison cannot see a job that slows down as a whole (a competing
process that every rank feels alike): no rank differs from the others. The
job's own past can. Per job step:

- the job's collective rate is the median over its ranks of the completed
  collective calls per second: ``nccl_calls_per_s`` for NCCL jobs,
  ``torch_collectives_per_s`` (gloo collectives issued, from the always-on
  marks) for CPU jobs, else ``torch_comm_waits_per_s`` (gloo's waits: duty-
  cycled, so a noisy estimate, and missing while detached), whichever at
  least half the ranks report;
- iteration time. A training step issues the same collectives every
  iteration, so the collective rate is (calls per iteration) / (iteration
  time). The windows carry per-window counts, not call timestamps, so the
  period cannot be read off the call cadence inside a window (Greyhound's
  method needs the per-call times); what they do give is the iteration time
  relative to the job's own baseline: ``job_iteration_time_ratio`` =
  baseline rate / current rate (1.25: iterations take 25% longer);
- a change is a step or a drift. A step: the rate is ``z_enter`` deviations
  from the healthy history's trimmed mean (its counts are whole collectives
  per window: _trimmed_scale), flagged in the window it
  happens; only a fall counts (a job that runs faster is not slowed down,
  e.g. one recovering after a slow regime was accepted as its normal). A
  drift: river's Page-Hinkley test on the rate relative to the
  baseline, which accumulates small shifts that no single window shows, and
  flags once the rate is also ``z_exit`` deviations away;
- while a change lasts the history is frozen (the slowdown is not learned as
  normal); it ends when the rate is back within ``z_exit`` deviations and
  nearer the healthy baseline than the change's own level (its mean). After
  ``regime_windows`` flagged windows in a row the new rate is accepted as the
  job's new normal (as JobModel does for a new phase).

Windows in which no rank completed a collective are left out (a hang is
model/loud.py's).

The job's OFU (``job_gpu_ofu``: the mean over its ranks of each rank's own
GPU's OFU, streams/rank_context.job_gpu_means) is judged the same way, on
its own history: ``job_ofu_ratio`` = current / healthy baseline (median). A
fall of ``z_enter`` robust deviations that is also at least ``ofu_min_drop``
of the baseline flags the step (the seed's 2.5x OFU regression); a rise is
not a regression. Windows without GPM (no OFU) are left out.

Checkpointed with the job's model (``state``/``load``, a checkpoint part:
plain numbers, river's Page-Hinkley reduced to its six running numbers); a
restarted worker goes on with the same baselines, change counters and sums.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
from river.drift import PageHinkley

from fleetscope.streams.model.checkpoint import JobPart

RATE_FEATURES = ("nccl_calls_per_s", "torch_collectives_per_s", "torch_comm_waits_per_s")
OFU_FEATURE = "job_gpu_ofu"
MAD_TO_SIGMA = 1.4826
# The rate's scale is at least 5% of its level. Healthy jobs vary by a few percent a window and dip by more now
# and then: the dev scenarios' healthy 3-rank gloo job (64-68 collectives a second, from the always-on marks)
# dipped to 58 in a window with nothing happening, and to 56-60 for the 3 windows the governor first attached
# gloo's waits. At 2% a job this steady has a scale of about 1.5 collectives a second, and those dips were job
# flags (the healthy run: 5 windows); the old rate, gloo's waits, was noisy enough to hide them.
REL_FLOOR = 0.05


@dataclass
class JobRateResult:
    flagged: bool                  # the collective rate left the job's history
    features: dict[str, float]     # job_collective_rate, job_rate_z, job_iteration_time_ratio, job_ofu_ratio
    rate_feature: str | None
    ofu_flagged: bool = False      # the job's OFU fell against its history


class OwnHistory:
    """One job series against its own healthy past: a median/MAD baseline, frozen while a change lasts,
    restarted from the new level after ``regime_windows`` flagged windows in a row. A change also remembers
    its own level (the mean of its windows), so that one noisy window of a slowdown does not end it."""

    def __init__(self, size: int):
        self.values: deque[float] = deque(maxlen=size)
        self.in_change = 0
        self.change_sum: float | None = 0.0   # the change's windows summed; None: not known (an older checkpoint)

    def baseline(self, counted: bool = False) -> tuple[float, float]:
        """(level, scale) of the healthy history: median and MAD, or for a ``counted`` series (whole events per
        window) the trimmed mean and deviation (_trimmed_scale)."""
        return _trimmed_scale(self.values) if counted else _median_scale(self.values)

    def nearer_change(self, x: float, base: float) -> bool:
        """While a change lasts: ``x`` is nearer the change's level than the healthy baseline, so the change
        goes on even where ``x`` alone is within the exit deviations of the baseline. A job slowed by a third
        whose history holds a healthy dip has a wide scale: in a dev job_wide_slowdown run the slow windows
        read -2.3..-4 deviations, the first one under z_exit ended the change, and the history then learned
        the slow rate (recall 0.01)."""
        if not self.in_change or self.change_sum is None:
            return False
        level = self.change_sum / self.in_change
        return abs(x - level) < abs(x - base)

    @classmethod
    def restored(cls, size: int, arrays, values_name: str, in_change: int, change_sum: float | None) -> "OwnHistory":
        """A history from a checkpoint part: its values are the array ``values_name`` (at most ``size``, all
        finite), its counters already read from the part's meta; a change sum that is given must be finite."""
        hist = cls(size)
        values = arrays.take(values_name, "f8", (None,))
        if len(values) > size or not np.isfinite(values).all():
            arrays.fail(f"{values_name}: {len(values)} values, at most {size} finite ones")
        if change_sum is not None and not math.isfinite(change_sum):
            arrays.fail(f"{values_name}: its change sum {change_sum!r} is not finite")
        hist.values.extend(values.tolist())
        hist.in_change, hist.change_sum = in_change, change_sum
        return hist

    def settle(self, x: float, flagged: bool, regime_windows: int) -> tuple[bool, bool]:
        """Learn ``x`` unless it is part of a change; (still flagged, a new regime was accepted)."""
        if not flagged:
            self.in_change = 0
            self.change_sum = 0.0
            self.values.append(x)
            return False, False
        self.in_change += 1
        if self.change_sum is not None:
            self.change_sum += x
        if self.in_change <= regime_windows:
            return True, False
        self.values.clear()
        self.values.append(x)
        self.in_change = 0
        self.change_sum = 0.0
        return False, True


class _JobRateState:
    def __init__(self, history: int, ph_threshold: float):
        self.rate = OwnHistory(history)
        self.ph = new_page_hinkley(ph_threshold)
        self.ofu = OwnHistory(history)


def saved_newest(meta, arrays) -> int:
    """A job part's newest window start as saved (-1: none yet), checked."""
    newest = meta.get("newest") if isinstance(meta, dict) else None
    if type(newest) is not int or not -1 <= newest < 1 << 63:
        arrays.fail(f"newest: {newest!r} is not a window start in ns")
    return newest


def new_page_hinkley(threshold: float) -> PageHinkley:
    return PageHinkley(min_instances=5, delta=0.01, threshold=threshold)


# Page-Hinkley's state is six numbers (river 0.26: its running mean and the two cumulative sums with their
# extremes); saved as numbers, restored into a fresh detector, so a checkpoint holds no river object.
_PH_FIELDS = ("n", "mean", "sum_increase", "sum_decrease", "min_increase", "max_decrease")


def page_hinkley_state(ph: PageHinkley) -> dict:
    values = (ph._x_mean.n, ph._x_mean._mean, ph._sum_increase, ph._sum_decrease, ph._min_increase,
              ph._max_decrease)
    # JSON has no infinity: min_increase starts at +inf
    return {**{k: (None if math.isinf(v) else float(v)) for k, v in zip(_PH_FIELDS, values)},
            "drift": bool(ph.drift_detected)}


def restore_page_hinkley(doc, threshold: float, arrays) -> PageHinkley:
    ph = new_page_hinkley(threshold)
    values = [arrays.number(doc, k, allow_none=(k == "min_increase")) for k in _PH_FIELDS]
    if values[0] < 0 or values[0] != int(values[0]):
        arrays.fail(f"ph.n: {values[0]!r} is not a count")
    ph._x_mean.n, ph._x_mean._mean = float(values[0]), float(values[1])
    ph._sum_increase, ph._sum_decrease = float(values[2]), float(values[3])
    ph._min_increase = math.inf if values[4] is None else float(values[4])
    ph._max_decrease = float(values[5])
    ph._drift_detected = arrays.flag(doc, "drift")
    return ph


class JobRates:
    def __init__(self, warmup: int = 10, z_enter: float = 6.0, z_exit: float = 3.0, history: int = 60,
                 regime_windows: int = 20, ph_threshold: float = 0.5, ofu_min_drop: float = 0.2):
        self.warmup = warmup
        self.z_enter = z_enter
        self.z_exit = z_exit
        self.history_len = history
        self.regime_windows = regime_windows
        self.ph_threshold = ph_threshold
        self.ofu_min_drop = ofu_min_drop
        self.jobs: dict[tuple[str, str], _JobRateState] = {}
        self.newest: dict[tuple[str, str], int] = {}
        self.counts = {"windows": 0, "flagged": 0, "drifts": 0, "regimes": 0, "ofu_windows": 0, "ofu_flagged": 0}

    def part(self, job: tuple[str, str]) -> JobPart:
        return JobPart(self, job)

    def state(self, job: tuple[str, str]) -> tuple[dict, dict[str, np.ndarray]]:
        """The job's histories, change counters and Page-Hinkley sums: plain numbers and arrays."""
        st = self.jobs.get(job)
        meta = {"newest": self.newest.get(job, -1), "known": st is not None}
        if st is None:
            return meta, {}
        meta.update(rate_in_change=st.rate.in_change, ofu_in_change=st.ofu.in_change, ph=page_hinkley_state(st.ph),
                    rate_change_sum=st.rate.change_sum, ofu_change_sum=st.ofu.change_sum)
        return meta, {"rate_history": np.array(st.rate.values, dtype=np.float64),
                      "ofu_history": np.array(st.ofu.values, dtype=np.float64)}

    def load(self, job: tuple[str, str], meta: dict, arrays) -> None:
        newest = saved_newest(meta, arrays)
        if not arrays.flag(meta, "known"):
            self.forget(job)
            return
        st = _JobRateState(self.history_len, self.ph_threshold)
        histories = []
        for name in ("rate", "ofu"):
            in_change = arrays.count(meta, f"{name}_in_change", 1 << 31)
            change_sum = arrays.number(meta, f"{name}_change_sum", allow_none=True)   # None: saved before
            histories.append(OwnHistory.restored(self.history_len, arrays, f"{name}_history", in_change, change_sum))
        st.rate, st.ofu = histories
        st.ph = restore_page_hinkley(meta.get("ph"), self.ph_threshold, arrays)
        self.jobs[job] = st
        self.newest[job] = newest

    def forget(self, job: tuple[str, str]) -> None:
        self.jobs.pop(job, None)
        self.newest.pop(job, None)

    def step(self, job: tuple[str, str], start_ns: int,
             vectors: Sequence[Mapping[str, float]]) -> JobRateResult | None:
        """Judge one job step; None when it carries neither a collective rate nor the job's OFU (or is late
        or replayed)."""
        if start_ns <= self.newest.get(job, -1):
            return None
        self.newest[job] = start_ns
        name, rate = job_rate(vectors)
        ofu = job_ofu(vectors)
        if (name is None or rate <= 0) and ofu is None:
            return None
        st = self.jobs.setdefault(job, _JobRateState(self.history_len, self.ph_threshold))
        features: dict[str, float] = {}
        flagged = ofu_flagged = False
        if name is not None and rate > 0:
            flagged = self._judge_rate(st, rate, features)
        else:
            name = None
        if ofu is not None:
            ofu_flagged = self._judge_ofu(st, ofu, features)
        return JobRateResult(flagged, features, name, ofu_flagged)

    def _judge_rate(self, st: _JobRateState, rate: float, features: dict) -> bool:
        self.counts["windows"] += 1
        features["job_collective_rate"] = rate
        if len(st.rate.values) < self.warmup:
            st.rate.values.append(rate)
            st.ph.update(1.0)
            return False
        base, scale = st.rate.baseline(counted=True)
        z = (rate - base) / scale
        st.ph.update(rate / base)
        drift = st.ph.drift_detected
        self.counts["drifts"] += drift
        # only a fall is a slowdown: a job back at its old rate after a slow regime was accepted as its new
        # normal (dev scenario dataloader_stall: 30 s at a quarter of the rate, then 19 windows flagged `job`
        # on every rank as the rate recovered) is not a fault
        fall = -z
        if st.rate.in_change:
            flagged = fall >= self.z_exit or st.rate.nearer_change(rate, base)
        else:
            flagged = fall >= self.z_enter or (drift and fall >= self.z_exit)
        flagged, regime = st.rate.settle(rate, flagged, self.regime_windows)
        if regime:   # the job's new normal: relearn from here
            st.ph = new_page_hinkley(self.ph_threshold)
            self.counts["regimes"] += 1
        self.counts["flagged"] += flagged
        features.update(job_rate_z=z, job_iteration_time_ratio=base / rate)
        return flagged

    def _judge_ofu(self, st: _JobRateState, ofu: float, features: dict) -> bool:
        """Only a fall is a regression: more tensor work per busy second is not a fault."""
        self.counts["ofu_windows"] += 1
        if len(st.ofu.values) < self.warmup:
            st.ofu.values.append(ofu)
            return False
        base, scale = st.ofu.baseline()
        if base <= 0:   # a job that did no tensor work has no OFU to lose
            st.ofu.values.append(ofu)
            return False
        z = (ofu - base) / scale
        ratio = ofu / base
        low = ratio <= 1 - self.ofu_min_drop
        if st.ofu.in_change:
            flagged = (low and z <= -self.z_exit) or st.ofu.nearer_change(ofu, base)
        else:
            flagged = low and z <= -self.z_enter
        flagged, regime = st.ofu.settle(ofu, flagged, self.regime_windows)
        self.counts["regimes"] += regime
        self.counts["ofu_flagged"] += flagged
        features["job_ofu_ratio"] = ratio
        return flagged


def job_rate(vectors: Sequence[Mapping[str, float]]) -> tuple[str | None, float]:
    """The first of RATE_FEATURES that at least half the ranks report, and its median over them."""
    for name in RATE_FEATURES:
        values = sorted(float(v[name]) for v in vectors if name in v and math.isfinite(float(v[name])))
        if values and 2 * len(values) >= len(vectors):
            return name, _median(values)
    return None, 0.0


def job_ofu(vectors: Sequence[Mapping[str, float]]) -> float | None:
    """The step's job OFU (the same on every rank's joined vector: job_gpu_means), None without GPM."""
    for v in vectors:
        x = v.get(OFU_FEATURE)
        if x is not None and math.isfinite(float(x)):
            return float(x)
    return None


def _median_scale(values) -> tuple[float, float]:
    xs = sorted(values)
    med = _median(xs)
    mad = _median(sorted(abs(x - med) for x in xs))
    return med, max(MAD_TO_SIGMA * mad, REL_FLOOR * abs(med), 1e-9)


# The share of a counted history cut from each end before its mean and deviation: a start-up window or a
# healthy dip must not widen the scale.
TRIM = 0.1


def _trimmed_scale(values) -> tuple[float, float]:
    """Mean and standard deviation of the history without its lowest and highest TRIM, the deviation at least
    REL_FLOOR of the level. For the collective rate, not median and MAD: a job completing 7 or 8 collectives in
    each 1 s window (dev scenario slow_link's 3-rank NCCL stand-in) has a median of 7 or 8 and a MAD of 0, 0.5 or
    1 by which count happens to hold the middle. In one run of it the median landed on 7 with a MAD of 1 (a
    scale of 1.48, 20% of the level), and a slowdown to 4 a second, iterations 1.75 times as long, read -2.0
    deviations: never flagged, against every window in the run before. The trimmed mean sits between the two
    counts (7.5) and their deviation is 0.5 whichever holds the middle: the same slowdown reads -7."""
    xs = sorted(values)
    cut = int(len(xs) * TRIM)
    core = xs[cut:len(xs) - cut] or xs
    mean = math.fsum(core) / len(core)
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in core) / len(core))
    return mean, max(sd, REL_FLOOR * abs(mean), 1e-9)


def _median(xs: list[float]) -> float:
    n = len(xs)
    return 0.5 * (xs[(n - 1) // 2] + xs[n // 2])
