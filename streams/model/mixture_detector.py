"""The mixture detector: the negative log-likelihood of each rank's admitted features under the
job's online Gaussian mixture (gmm.py), explained by its per-feature terms ("contributions")."""
from __future__ import annotations

import numpy as np

from fleetscope.streams.model.detector import WindowCells
from fleetscope.streams.model.gmm import GaussianMixture, GMMConfig, Scored
from fleetscope.streams.model.scaling import AffineChange
from fleetscope.streams.model.top_features import TopFeatures


class MixtureDetector:
    name = "gmm"
    fixed_threshold = None
    admits_late = True
    explains = "contributions"

    def __init__(self, cfg: GMMConfig):
        self.mixture = GaussianMixture(cfg)
        self._scored: tuple[WindowCells, Scored] | None = None   # the last window's score: learn reuses it
        self._contrib: tuple[np.ndarray, np.ndarray] | None = None

    @classmethod
    def from_config(cls, c) -> "MixtureDetector":
        return cls(GMMConfig(covariance=c.covariance, k=c.k, max_components=c.max_components, alpha=c.alpha,
                             eta_min=c.eta_min, var_floor=c.var_floor, shrinkage=c.shrinkage, spawn_p=c.spawn_p,
                             merge_bd=c.merge_bd, seed=c.seed))

    def grow(self, d: int, names: list[str]) -> None:
        self.mixture.grow(d)

    def score(self, w: WindowCells) -> np.ndarray:
        sc = self.mixture.score(w.Zs, w.scored)
        if not w.shadow:
            self._scored = (w, sc)
            self._contrib = (self.mixture.contributions(w.Zs, w.scored, sc), w.scored)
        return sc.nll

    def explain(self, names: np.ndarray, k: int) -> TopFeatures | None:
        contrib, cells = self._contrib
        return TopFeatures(contrib, cells, contrib, names, k)

    def learn(self, w: WindowCells, weights: np.ndarray) -> None:
        # the responsibilities of this window's score weight the statistics (as one E-step)
        sc = self._scored[1] if self._scored is not None and self._scored[0] is w else None
        self.mixture.partial_fit(w.Z, w.usable, weights, scored=sc, compare=w.compare)
        self._scored = None

    def rescale(self, change: AffineChange) -> None:
        self.mixture.affine(change.a, change.b, change.moved, change.fresh)

    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        return self.mixture.state()

    def load(self, meta: dict, arrays, dim: int) -> None:
        self.mixture.load(meta, arrays, dim)

    def nbytes(self) -> int:
        return self.mixture.nbytes()
