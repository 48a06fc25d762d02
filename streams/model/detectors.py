"""The Mahalanobis comparison detector of the ensemble (HalfSpaceTrees: half_space_trees.py).

Mahalanobis: one Gaussian with full (shrunk) covariance, learned by the same
stepwise EM as the mixture (a GaussianMixture with k=1), on the standardized,
masked features; its score is the squared Mahalanobis distance over the
observed cells (sub-block of the covariance).
"""
from __future__ import annotations

import numpy as np

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
