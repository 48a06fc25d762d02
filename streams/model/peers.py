"""Peer comparison: the ranks of one job should look alike within a window.

For each rank i and feature j, over the ranks that observed j in this window:
    z_ij = (x_ij - median_j) / scale_j
    scale_j = max(1.4826 * MAD_j,            this window's robust spread
                  1.4826 * typical_MAD_j,     its running mean over past windows
                  rel_floor * |median_j|,     a relative floor
                  abs_floor)
The floors are what keep identical healthy ranks from producing huge z out of
tiny noise: one window's MAD from 8 ranks can be near zero by chance, but the
typical MAD (an exponential average over windows, robust to one odd rank
because MAD is) says how far apart healthy ranks usually are, and a feature
whose ranks agree to the last digit still gets ``rel_floor`` of its size.
Features observed by fewer than ``min_ranks`` ranks get z = 0 (no peers).
"""
from __future__ import annotations

import numpy as np

MAD_TO_SIGMA = 1.4826


def _masked_median(X: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """Column medians over observed cells (every column has at least one); sort-based, no NaN paths."""
    S = np.sort(np.where(observed, X, np.inf), axis=0)
    cnt = observed.sum(axis=0)
    cols = np.arange(X.shape[1])
    return 0.5 * (S[(cnt - 1) // 2, cols] + S[cnt // 2, cols])


class PeerComparison:
    def __init__(self, min_ranks: int = 3, rel_floor: float = 0.02, abs_floor: float = 1e-9,
                 typical_rate: float = 0.05):
        self.min_ranks = min_ranks
        self.rel_floor = rel_floor
        self.abs_floor = abs_floor
        self.typical_rate = typical_rate
        self.typical = np.zeros(0)     # running 1.4826*MAD per feature (NaN until seen)

    def grow(self, d: int) -> None:
        extra = d - self.typical.size
        if extra > 0:
            self.typical = np.concatenate([self.typical, np.full(extra, np.nan)])

    def zscores(self, X: np.ndarray, observed: np.ndarray, learn: bool = True) -> np.ndarray:
        """(n, D) robust z; 0 where masked or with too few peers."""
        n, D = X.shape
        self.grow(D)
        enough = observed.sum(axis=0) >= self.min_ranks
        if n < self.min_ranks or not enough.any():
            return np.zeros((n, D))
        cols = np.flatnonzero(enough)
        Xc = X[:, cols]
        Oc = observed[:, cols]
        med = _masked_median(Xc, Oc)
        mad = MAD_TO_SIGMA * _masked_median(np.abs(Xc - med), Oc)
        typ = self.typical[cols]
        if learn:
            r = self.typical_rate
            self.typical[cols] = np.where(np.isnan(typ), mad, (1 - r) * typ + r * mad)
        scale = np.fmax(mad, typ)   # fmax: a NaN typical (first window) is ignored
        scale = np.maximum(scale, np.maximum(self.rel_floor * np.abs(med), self.abs_floor))
        z = np.zeros((n, D))
        z[:, cols] = np.where(observed[:, cols], (Xc - med) / scale, 0.0)
        return z

    def state(self) -> dict[str, np.ndarray]:
        return {"typical": self.typical}

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        self.typical = arrays["typical"]
