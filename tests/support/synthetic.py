"""Synthetic per-rank feature streams for tests, benchmarks and evaluation.

A job of ``n_ranks`` ranks; ``n_features`` features split over three sources
(``gpu.*``, ``host.*``, ``nccl.*``) with magnitudes spread over decades.
Each value is base_j * (1 + cv_j * noise), with correlated noise: three
job-wide AR(1) factors shared by all ranks (the whole job speeds up or slows
down together), two per-rank AR(1) factors, and independent noise.
Planted faults change the multiplier of chosen (rank, feature) cells.
"""
from __future__ import annotations

import numpy as np

SOURCES = ("gpu", "host", "nccl")


class SyntheticJob:
    def __init__(self, n_ranks: int = 8, n_features: int = 30, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.n_ranks, self.n_features = n_ranks, n_features
        per = -(-n_features // len(SOURCES))
        self.names = [f"{SOURCES[j // per]}.f{j}" for j in range(n_features)]
        self.base = 10 ** self.rng.uniform(0, 6, n_features)
        self.cv = self.rng.uniform(0.01, 0.05, n_features)
        self.load_job = self.rng.normal(0, 0.5, (n_features, 3))
        self.load_rank = self.rng.normal(0, 0.4, (n_features, 2))
        self.f_job = np.zeros(3)
        self.f_rank = np.zeros((n_ranks, 2))

    def noise_sd(self) -> np.ndarray:
        """Stationary sd of each feature's relative noise (in units of cv)."""
        return np.sqrt((self.load_job ** 2).sum(1) + (self.load_rank ** 2).sum(1) + 0.5 ** 2)

    def matrix(self, factor: np.ndarray | None = None) -> np.ndarray:
        """One window's (n_ranks, n_features) values; ``factor`` multiplies cells (faults, drift)."""
        rho = 0.7
        s = np.sqrt(1 - rho ** 2)
        self.f_job = rho * self.f_job + s * self.rng.standard_normal(3)
        self.f_rank = rho * self.f_rank + s * self.rng.standard_normal((self.n_ranks, 2))
        rel = (self.load_job @ self.f_job)[None, :] + self.f_rank @ self.load_rank.T
        rel = rel + 0.5 * self.rng.standard_normal((self.n_ranks, self.n_features))
        X = self.base * (1.0 + self.cv * rel)
        return X if factor is None else X * factor

    def rows(self, X: np.ndarray, masked: dict[int, str] | None = None) -> list[tuple[int, dict[str, float]]]:
        """As the facade takes them; ``masked`` maps rank -> a source prefix that is missing."""
        masked = masked or {}
        out = []
        for r, row in enumerate(X.tolist()):
            drop = masked.get(r)
            out.append((r, {n: v for n, v in zip(self.names, row) if not (drop and n.startswith(drop + "."))}))
        return out

    def window(self, factor: np.ndarray | None = None, masked: dict[int, str] | None = None):
        return self.rows(self.matrix(factor), masked)
