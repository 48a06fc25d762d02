"""The Mahalanobis detector: one Gaussian with full (shrunk) covariance, learned by the same
stepwise EM as the mixture (a GaussianMixture with k=1), on the standardized, masked features;
its score is the squared Mahalanobis distance over the observed cells (sub-block of the covariance)."""
from __future__ import annotations

import numpy as np

from fleetscope.streams.model.detector import WindowCells
from fleetscope.streams.model.gmm import GaussianMixture, GMMConfig
from fleetscope.streams.model.scaling import AffineChange


class MahalanobisDetector:
    name = "mahalanobis"
    fixed_threshold = None
    admits_late = True
    explains = None

    def __init__(self, alpha: float, eta_min: float, var_floor: float, shrinkage: float):
        self.g = GaussianMixture(GMMConfig(covariance="full", k=1, alpha=alpha, eta_min=eta_min,
                                           var_floor=var_floor, shrinkage=shrinkage))

    @classmethod
    def from_config(cls, c) -> "MahalanobisDetector":
        return cls(c.alpha, c.eta_min, c.var_floor, c.shrinkage)

    def grow(self, d: int, names: list[str]) -> None:
        self.g.grow(d)

    def score(self, w: WindowCells) -> np.ndarray:
        sc = self.g.score(w.Zs, w.scored)
        return sc.maha[:, 0] if sc.maha.shape[1] else np.zeros(w.Z.shape[0])

    def explain(self, names, k):
        return None

    def learn(self, w: WindowCells, weights: np.ndarray) -> None:
        self.g.partial_fit(w.Z, w.usable, weights)

    def rescale(self, change: AffineChange) -> None:
        self.g.affine(change.a, change.b, change.moved, change.fresh)

    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        return self.g.state()

    def load(self, meta: dict, arrays, dim: int) -> None:
        self.g.load(meta, arrays, dim)

    def nbytes(self) -> int:
        return self.g.nbytes()
