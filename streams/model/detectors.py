"""The comparison detectors of the ensemble: Mahalanobis distance and river's HalfSpaceTrees.

Mahalanobis: one Gaussian with full (shrunk) covariance, learned by the same
stepwise EM as the mixture (a GaussianMixture with k=1), on the standardized,
masked features; its score is the squared Mahalanobis distance over the
observed cells (sub-block of the covariance).

HalfSpaceTrees (river): fed min-max scaled features. The per-feature min/max
are learned here from the rows that were not flagged. A masked cell is given
to the trees as 0.5 (mid-range): the trees need every feature they split on.
The trees split only on features known when they were built (river builds
them on the first row); a feature that appears later is not used by them.
This detector works row by row in Python (river's API), so it is the slow
one; the mixture's path stays vectorized.
Checkpoint: river's trees are stored as a pickle (river objects only; the
rest of the checkpoint is numpy arrays and JSON).
"""
from __future__ import annotations

import pickle

import numpy as np
from river.anomaly import HalfSpaceTrees

from fleetscope.streams.model.gmm import GaussianMixture, GMMConfig


class Mahalanobis:
    def __init__(self, alpha: float, eta_min: float, var_floor: float, shrinkage: float):
        self.g = GaussianMixture(GMMConfig(covariance="full", k=1, alpha=alpha, eta_min=eta_min,
                                           var_floor=var_floor, shrinkage=shrinkage))

    def grow(self, d: int) -> None:
        self.g.grow(d)

    def score(self, Z: np.ndarray, M: np.ndarray) -> np.ndarray:
        sc = self.g.score(Z, M)
        return sc.maha[:, 0] if sc.maha.shape[1] else np.zeros(Z.shape[0])

    def learn(self, Z: np.ndarray, M: np.ndarray, w: np.ndarray) -> None:
        self.g.partial_fit(Z, M, w)

    def affine(self, *args) -> None:
        self.g.affine(*args)


class HalfSpace:
    def __init__(self, n_trees: int = 10, height: int = 8, window_size: int = 100, seed: int = 0):
        self.hst = HalfSpaceTrees(n_trees=n_trees, height=height, window_size=window_size, seed=seed)
        self.lo = np.zeros(0)
        self.hi = np.zeros(0)

    def grow(self, d: int) -> None:
        extra = d - self.lo.size
        if extra > 0:
            self.lo = np.concatenate([self.lo, np.full(extra, np.inf)])
            self.hi = np.concatenate([self.hi, np.full(extra, -np.inf)])

    def _scaled(self, X: np.ndarray, M: np.ndarray) -> list[dict[int, float]]:
        span = self.hi - self.lo
        ok = M & np.isfinite(span) & (span > 0)
        S = np.where(ok, (np.where(M, X, 0.0) - self.lo) / np.where(ok, span, 1.0), 0.5)
        np.clip(S, 0.0, 1.0, out=S)
        return [dict(enumerate(row)) for row in S.tolist()]

    def score(self, X: np.ndarray, M: np.ndarray) -> np.ndarray:
        self.grow(X.shape[1])
        return np.array([self.hst.score_one(x) for x in self._scaled(X, M)], dtype=float)

    def learn(self, X: np.ndarray, M: np.ndarray, keep: np.ndarray) -> None:
        if not keep.any():
            return
        Xk, Mk = X[keep], M[keep]
        self.lo = np.fmin(self.lo, np.where(Mk, Xk, np.inf).min(axis=0))
        self.hi = np.fmax(self.hi, np.where(Mk, Xk, -np.inf).max(axis=0))
        for x in self._scaled(Xk, Mk):
            self.hst.learn_one(x)

    def state(self) -> dict[str, np.ndarray]:
        blob = np.frombuffer(pickle.dumps(self.hst, protocol=5), dtype=np.uint8)
        return {"lo": self.lo, "hi": self.hi, "river_pickle": blob}

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        self.lo, self.hi = arrays["lo"], arrays["hi"]
        self.hst = pickle.loads(arrays["river_pickle"].tobytes())

    def nbytes(self) -> int:
        return self.lo.nbytes + self.hi.nbytes + len(pickle.dumps(self.hst, protocol=5))
