"""Half-space trees (Tan, Ting & Liu, IJCAI 2011) whose whole state is numpy arrays.

The same algorithm as river's ``HalfSpaceTrees`` (trees built on the first
learned row, from the same random draws, so a seed gives the same trees and
the same scores), but the trees are arrays in heap order (node i has children
2i+1 and 2i+2) and a batch is walked for every tree at once. river keeps its
trees as Python objects, and the only way to save those was pickle: a crafted
checkpoint could then run code. These arrays are saved as arrays.

Inputs are min-max scaled here: the per-feature min/max are learned from the
rows that were not flagged. A masked cell is given to the trees as 0.5
(mid-range): the trees need every feature they split on. The trees split only
on the features known when they were built (the first learned row); a feature
that appears later is not used by them.
"""
from __future__ import annotations

import random

import numpy as np

PADDING = 0.15             # river's: a split point is never within 15% of its cell's edge


class HalfSpaceTrees:
    def __init__(self, n_trees: int = 10, height: int = 8, window_size: int = 100, seed: int = 0):
        self.n_trees, self.height, self.window_size, self.seed = n_trees, height, window_size, seed
        n_inner, n_nodes = 2 ** height - 1, 2 ** (height + 1) - 1
        self.n_features = 0                                   # features the trees split on; 0: not built
        self.feature = np.zeros((n_trees, n_inner), np.int64)
        self.split = np.zeros((n_trees, n_inner))
        self.l_mass = np.zeros((n_trees, n_nodes), np.int64)  # the current window's counts
        self.r_mass = np.zeros((n_trees, n_nodes), np.int64)  # the last full window's: the reference
        self.counter = 0                                      # rows learned in the current window
        self.first_window = True                              # no reference yet: every score is 0
        self.lo = np.zeros(0)
        self.hi = np.zeros(0)

    @property
    def size_limit(self) -> float:
        return 0.1 * self.window_size      # the paper's: a walk stops in a node this sparse

    @property
    def max_score(self) -> int:
        return self.n_trees * self.window_size * (2 ** (self.height + 1) - 1)

    # ------------------------------------------------------------ building
    def _build(self, d: int) -> None:
        """river's make_padded_tree, per tree, with the same draws from random.Random(seed)."""
        rng = random.Random(self.seed)
        for t in range(self.n_trees):
            limits = [[0.0, 1.0] for _ in range(d)]
            self._build_node(t, 0, self.height, limits, rng)
        self.n_features = d

    def _build_node(self, t: int, node: int, height: int, limits: list[list[float]], rng: random.Random) -> None:
        if height == 0:
            return
        on = rng.choices(population=range(len(limits)), weights=[hi - lo for lo, hi in limits])[0]
        a, b = limits[on]
        at = rng.uniform(a + PADDING * (b - a), b - PADDING * (b - a))
        self.feature[t, node], self.split[t, node] = on, at
        limits[on] = [a, at]
        self._build_node(t, 2 * node + 1, height - 1, limits, rng)
        limits[on] = [at, b]
        self._build_node(t, 2 * node + 2, height - 1, limits, rng)
        limits[on] = [a, b]

    def _paths(self, S: np.ndarray) -> list[np.ndarray]:
        """Per depth 0..height, the (trees, rows) node each row reaches."""
        trees = np.arange(self.n_trees)[:, None]
        rows = np.arange(S.shape[0])[None, :]
        node = np.zeros((self.n_trees, S.shape[0]), np.int64)
        out = [node]
        for _ in range(self.height):
            f = self.feature[trees, node]
            right = S[rows, f] >= self.split[trees, node]
            node = 2 * node + 1 + right
            out.append(node)
        return out

    # ------------------------------------------------------------- scaling
    def grow(self, d: int) -> None:
        extra = d - self.lo.size
        if extra > 0:
            self.lo = np.concatenate([self.lo, np.full(extra, np.inf)])
            self.hi = np.concatenate([self.hi, np.full(extra, -np.inf)])

    def _scaled(self, X: np.ndarray, M: np.ndarray) -> np.ndarray:
        span = self.hi - self.lo
        ok = M & np.isfinite(span) & (span > 0)
        S = np.where(ok, (np.where(M, X, 0.0) - self.lo) / np.where(ok, span, 1.0), 0.5)
        np.clip(S, 0.0, 1.0, out=S)
        return S

    # -------------------------------------------------------------- public
    def score(self, X: np.ndarray, M: np.ndarray) -> np.ndarray:
        """1 - (mass-weighted depth reached) / max: higher is more anomalous, in [0, 1]."""
        self.grow(X.shape[1])
        n = X.shape[0]
        if self.first_window or n == 0:
            return np.zeros(n)
        trees = np.arange(self.n_trees)[:, None]
        total = np.zeros((self.n_trees, n))
        alive = np.ones((self.n_trees, n), bool)
        for depth, node in enumerate(self._paths(self._scaled(X, M))):
            r = self.r_mass[trees, node]
            total += np.where(alive, r * float(2 ** depth), 0.0)
            alive &= r >= self.size_limit
        return 1.0 - total.sum(axis=0) / self.max_score

    def learn(self, X: np.ndarray, M: np.ndarray, keep: np.ndarray) -> None:
        if not keep.any():
            return
        Xk, Mk = X[keep], M[keep]
        self.lo = np.fmin(self.lo, np.where(Mk, Xk, np.inf).min(axis=0))
        self.hi = np.fmax(self.hi, np.where(Mk, Xk, -np.inf).max(axis=0))
        S = self._scaled(Xk, Mk)
        if not self.n_features:
            self._build(S.shape[1])
        S = S[:, :self.n_features]
        n_nodes = self.l_mass.shape[1]
        start = 0
        while start < S.shape[0]:            # the masses pivot every window_size rows, as row by row
            stop = min(S.shape[0], start + self.window_size - self.counter)
            flat = np.concatenate([node + np.arange(self.n_trees)[:, None] * n_nodes
                                   for node in self._paths(S[start:stop])], axis=None)
            self.l_mass += np.bincount(flat, minlength=self.l_mass.size).reshape(self.l_mass.shape)
            self.counter += stop - start
            if self.counter == self.window_size:
                self.r_mass, self.l_mass = self.l_mass, np.zeros_like(self.l_mass)
                self.first_window, self.counter = False, 0
            start = stop

    # ----------------------------------------------------------- checkpoint
    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        meta = {"n_features": self.n_features, "counter": self.counter, "first_window": self.first_window}
        return meta, {"lo": self.lo, "hi": self.hi, "feature": self.feature, "split": self.split,
                      "l_mass": self.l_mass, "r_mass": self.r_mass}

    def load(self, meta: dict, arrays, dim: int) -> None:
        """arrays: a StateArrays; every shape and value range is checked against this detector's settings."""
        n_features = arrays.count(meta, "n_features", dim)
        self.counter = arrays.count(meta, "counter", self.window_size - 1)
        self.first_window = arrays.flag(meta, "first_window")
        self.lo = arrays.take("lo", "f8", (dim,))
        self.hi = arrays.take("hi", "f8", (dim,))
        inner, nodes = self.feature.shape, self.l_mass.shape
        feature = arrays.take("feature", "i8", inner)
        if n_features and (feature.min(initial=0) < 0 or feature.max(initial=0) >= n_features):
            arrays.fail(f"feature: split features must lie in [0, {n_features})")
        self.feature, self.split = feature, arrays.take("split", "f8", inner)
        self.l_mass, self.r_mass = arrays.take("l_mass", "i8", nodes), arrays.take("r_mass", "i8", nodes)
        if self.l_mass.min(initial=0) < 0 or self.r_mass.min(initial=0) < 0:
            arrays.fail("l_mass/r_mass: a mass cannot be negative")
        self.n_features = n_features

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.lo, self.hi, self.feature, self.split, self.l_mass, self.r_mass))


class HalfSpaceDetector:
    """Half-space trees as a job-model detector: scores the usable raw values, learns the normal rows."""
    name = "hst"
    fixed_threshold = None
    admits_late = False
    explains = None

    def __init__(self, trees: HalfSpaceTrees):
        self.trees = trees

    @classmethod
    def from_config(cls, c) -> "HalfSpaceDetector":
        return cls(HalfSpaceTrees(c.hst_trees, c.hst_height, c.hst_window, c.seed))

    def grow(self, d: int, names: list[str]) -> None:
        self.trees.grow(d)

    def score(self, w) -> np.ndarray:
        return self.trees.score(w.X, w.usable)

    def explain(self, names, k):
        return None

    def learn(self, w, weights: np.ndarray) -> None:
        self.trees.learn(w.X, w.usable, weights >= 1.0)

    def rescale(self, change) -> None:
        pass                      # min-max scales raw values itself

    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        return self.trees.state()

    def load(self, meta: dict, arrays, dim: int) -> None:
        self.trees.load(meta, arrays, dim)

    def nbytes(self) -> int:
        return self.trees.nbytes()
