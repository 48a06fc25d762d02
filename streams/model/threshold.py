"""Streaming tail threshold without a healthy baseline: SPOT / DSPOT.

Peaks-over-threshold (Siffer et al., KDD 2017). Calibration: from the scores
seen in warm-up, an initial threshold u is the ``level`` quantile; the
excesses over u (the peaks) are fitted by a generalized Pareto distribution,
and the alarm threshold is the value exceeded with probability ``risk``:
    z = u + sigma/gamma * ((risk * n / N_u) ** -gamma - 1)   (gamma != 0)
    z = u - sigma * log(risk * n / N_u)                        (gamma == 0)
Streaming: a score above z is an alarm and is not learned; a score above u
is a new peak (GPD refitted, z recomputed); otherwise only n grows.

DSPOT (``depth`` > 0) runs the same on x - m, where m is the mean of the last
``depth`` normal scores, so a slow drift of the score level moves the
threshold with it instead of alarming forever.

Warm-up scores are not all healthy: one window whose feature was constant until then
can score 10^5 where the rest score 10^1, and fitted as a peak it would lift the
threshold out of reach for the rest of the run (measured in the evaluation:
threshold 4.8e5 against healthy scores near 0 and a fault at 354). Calibration
therefore caps warm-up scores at median + ``warm_clip_mads`` robust deviations
(1.4826 * MAD) first, as the stream never learns an alarm either.

Both are taken around the warm-up's trend (``warm_detrend``), not its level:
warm-up scores fall as the mixture learns, and a spread read around one level
holds that fall. Measured on the dev scenario ``job_wide_slowdown``: 30 scores
falling from 4 to -4, with one window where every rank scored 26, capped at
37 (no cap), and the threshold fitted on that window's peaks was 165, above
the fault's scores (about 30). The trend is the median slope between each
score and the one half the warm-up later (robust to a quarter of outliers,
O(n)); the cap is that line + ``warm_clip_mads`` deviations of the residuals.

With few peaks the fitted scale is itself uncertain (its standard error is
about sigma / sqrt(N_peaks)), and a threshold read from a 45-score warm-up
alarmed at about 4x its risk on simulated healthy scores. ``tail_uncertainty``
widens the scale used for the threshold to sigma * (1 + c / sqrt(N_peaks)): a
one-standard-error margin at c = 1 (the default), which brings that rate back
to about the risk and fades as peaks accumulate.

The GPD is fitted by the method of moments (closed form, cheap enough to
refit on every peak); gamma is clipped to [-0.5, 0.5] since a few dozen peaks
cannot support more. Memory is bounded: at most ``max_peaks`` peaks are
kept; beyond that the oldest goes and n is scaled down to keep the peak rate.
"""
from __future__ import annotations

import numpy as np


class DSpot:
    def __init__(self, risk: float = 1e-3, level: float = 0.98, depth: int = 200,
                 max_peaks: int = 2000, max_init: int = 5000, gamma_min: float = 0.0,
                 warm_clip_mads: float = 10.0, tail_uncertainty: float = 0.0, warm_detrend: bool = True):
        self.gamma_min = gamma_min
        self.warm_detrend = warm_detrend
        self.tail_uncertainty = tail_uncertainty
        self.warm_clip_mads = warm_clip_mads
        self.risk = risk
        self.level = level
        self.depth = depth
        self.max_peaks = max_peaks
        self.max_init = max_init
        self.init = np.zeros(0)
        self.recent = _Ring(depth)     # last `depth` normal scores (DSPOT)
        self.peaks = _Ring(max_peaks)
        self.n = 0.0
        self.u = 0.0
        self.sigma = 1.0
        self.gamma = 0.0
        self.z: float | None = None    # alarm threshold on the de-trended score

    # ------------------------------------------------------------ helpers
    def _local(self) -> float:
        # the mean needs no order: the stored slots as they lie, not values()'s ordered copy
        return float(self.recent.buf[:self.recent.count].mean()) if self.depth and self.recent.count else 0.0

    def _fit(self) -> None:
        y = self.peaks.values()
        if y.size < 2:
            self.sigma, self.gamma = max(float(y.mean()) if y.size else 1e-9, 1e-9), 0.0
        else:
            m, v = float(y.mean()), float(y.var())
            if v <= 0:
                self.sigma, self.gamma = max(m, 1e-9), 0.0
            else:
                r = m * m / v
                self.gamma = float(np.clip(0.5 * (1.0 - r), self.gamma_min, 0.5))
                self.sigma = max(m * (1.0 - self.gamma), 1e-9)
        ratio = self.risk * self.n / max(y.size, 1)
        sigma = self.sigma * (1.0 + self.tail_uncertainty / np.sqrt(max(y.size, 1)))
        if abs(self.gamma) < 1e-6:
            self.z = self.u - sigma * np.log(ratio)
        else:
            self.z = self.u + sigma / self.gamma * (ratio ** -self.gamma - 1.0)
        self.z = max(self.z, self.u)

    def _warm_cap(self, x: np.ndarray) -> np.ndarray | float:
        """Per warm-up score, the most it may count for: its trend line (or the median) + warm_clip_mads
        robust deviations of the scores around it; +inf where they do not spread."""
        level: np.ndarray | float = float(np.median(x))
        if self.warm_detrend and x.size >= 4:
            half = x.size // 2
            slope = float(np.median((x[half:2 * half] - x[:half]) / half))
            i = np.arange(x.size)
            level = slope * i + float(np.median(x - slope * i))
        resid = x - level
        centre = float(np.median(resid))
        spread = 1.4826 * float(np.median(np.abs(resid - centre)))
        if spread <= 0:
            return np.inf
        return level + centre + self.warm_clip_mads * spread

    # -------------------------------------------------------------- public
    @property
    def calibrated(self) -> bool:
        return self.z is not None

    def threshold(self) -> float | None:
        """The current alarm threshold on the raw score scale."""
        return None if self.z is None else self.z + self._local()

    def warm(self, x: np.ndarray) -> None:
        """Scores seen during warm-up (kept for calibration, bounded)."""
        self.init = np.concatenate([self.init, np.asarray(x, float)])[-self.max_init:]

    def calibrate(self) -> None:
        x = self.init
        if x.size < 10:
            raise ValueError(f"DSPOT needs at least 10 warm-up scores to calibrate, got {x.size}")
        if self.warm_clip_mads > 0:
            x = np.minimum(x, self._warm_cap(x))
        if self.depth:
            # de-trend each score by the mean of the `depth` before it (or all before, at the start)
            c = np.concatenate([[0.0], np.cumsum(x)])
            i = np.arange(x.size)
            lo = np.maximum(i - self.depth, 0)
            cnt = np.maximum(i - lo, 1)
            local = np.where(i > 0, (c[i] - c[lo]) / cnt, x[0])
            y = x - local
            self.recent.extend(x)
        else:
            y = x
        self.u = float(np.quantile(y, self.level))
        peaks = y[y > self.u] - self.u
        self.n = float(y.size) * min(1.0, self.max_peaks / max(peaks.size, 1))
        self.peaks.extend(peaks)
        self.init = np.zeros(0)
        self._fit()

    def step(self, x: np.ndarray, learn: bool = True) -> np.ndarray:
        """Flag a batch of scores against the current threshold, then learn the normal ones."""
        x = np.asarray(x, float)
        y = x - self._local()
        alarm = y > self.z
        if not learn:
            return alarm
        normal = ~alarm
        new = y[normal & (y > self.u)] - self.u
        self.n += float(normal.sum())
        if new.size:
            total = self.peaks.count + new.size
            if total > self.max_peaks:      # the oldest peaks go: keep the peak rate N_u / n
                self.n *= self.max_peaks / total
            self.peaks.extend(new)
            self._fit()
        if self.depth:
            self.recent.extend(x[normal])
        return alarm

    # ----------------------------------------------------------- checkpoint
    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        meta = {"n": self.n, "u": self.u, "sigma": self.sigma, "gamma": self.gamma, "z": self.z}
        meta["recent"], meta["peaks"] = self.recent.meta(), self.peaks.meta()
        return meta, {"init": self.init, "recent": self.recent.buf, "peaks": self.peaks.buf}

    def load(self, meta: dict, arrays) -> None:
        """arrays: a StateArrays; the rings must have this threshold's capacities."""
        self.n, self.u, self.sigma, self.gamma = (arrays.number(meta, k) for k in ("n", "u", "sigma", "gamma"))
        self.z = arrays.number(meta, "z", allow_none=True)
        init = arrays.take("init", "f8", (None,))
        if init.size > self.max_init:
            arrays.fail(f"init: {init.size} warm-up scores, over the limit of {self.max_init}")
        self.init = init
        for ring, key in ((self.recent, "recent"), (self.peaks, "peaks")):
            ring_meta = arrays.mapping(meta, key)
            cap = ring.buf.size
            ring.load({"count": arrays.count(ring_meta, "count", cap),
                       "head": arrays.count(ring_meta, "head", max(cap - 1, 0))},
                      arrays.take(key, "f8", (cap,)))

    def nbytes(self) -> int:
        return self.init.nbytes + self.recent.buf.nbytes + self.peaks.buf.nbytes


class _Ring:
    """Fixed-capacity FIFO of floats, allocated once (memory does not grow)."""

    def __init__(self, capacity: int):
        self.buf = np.zeros(capacity)
        self.count = 0
        self.head = 0          # next write position

    def extend(self, x: np.ndarray) -> None:
        cap = self.buf.size
        if cap == 0 or x.size == 0:
            return
        x = x[-cap:]
        idx = (self.head + np.arange(x.size)) % cap
        self.buf[idx] = x
        self.head = int((self.head + x.size) % cap)
        self.count = min(self.count + x.size, cap)

    def values(self) -> np.ndarray:
        """The stored values, oldest first."""
        if self.count < self.buf.size:
            return self.buf[:self.count]
        return np.concatenate([self.buf[self.head:], self.buf[:self.head]])

    def meta(self) -> dict:
        return {"count": self.count, "head": self.head}

    def load(self, meta: dict, buf: np.ndarray) -> None:
        self.count, self.head, self.buf = meta["count"], meta["head"], buf.copy()
