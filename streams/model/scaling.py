"""Streaming per-feature standardization that honours masks.

Each dimension keeps its own count, mean and M2 (Chan/Welford merge of a
batch), over its observed values only. A dimension is *ready* (usable by the
models) once it has ``min_obs`` observations; it keeps learning until
``freeze_obs`` and is then frozen, so after warm-up the model's coordinates
stop moving. While a ready dimension still moves, ``update`` returns the
affine map old-standardized -> new-standardized so the models can carry their
statistics across exactly (see ``GaussianMixture.affine``).

The scale has a floor, ``max(rel_floor * |mean|, abs_floor)``: a feature that
was constant during warm-up does not turn a tiny change into an infinite z.
Standardized values are clipped to +/- ``clip``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class AffineChange:
    """x_new = a * x_old + b on ``moved`` dims; ``fresh`` dims just became ready."""
    a: np.ndarray
    b: np.ndarray
    moved: np.ndarray
    fresh: np.ndarray


class MaskedStandardizer:
    def __init__(self, min_obs: int = 8, freeze_obs: int = 256, rel_floor: float = 1e-3,
                 abs_floor: float = 1e-6, clip: float = 50.0):
        self.min_obs = min_obs
        self.freeze_obs = freeze_obs
        self.rel_floor = rel_floor
        self.abs_floor = abs_floor
        self.clip = clip
        self.count = np.zeros(0)
        self.mean = np.zeros(0)
        self.m2 = np.zeros(0)
        self._scale: np.ndarray | None = None   # scale() until count/mean/m2 change
        self._frozen = False                     # every dim frozen: update has nothing to learn

    def grow(self, d: int) -> None:
        extra = d - self.count.size
        if extra > 0:
            self.count = np.concatenate([self.count, np.zeros(extra)])
            self.mean = np.concatenate([self.mean, np.zeros(extra)])
            self.m2 = np.concatenate([self.m2, np.zeros(extra)])
            self._scale, self._frozen = None, False

    def ready(self) -> np.ndarray:
        return self.count >= self.min_obs

    def scale(self) -> np.ndarray:
        """Per-dimension scale; cached until the statistics change (frozen dims never do)."""
        if self._scale is None:
            std = np.sqrt(self.m2 / np.maximum(self.count, 1.0))
            self._scale = np.maximum(std, np.maximum(self.rel_floor * np.abs(self.mean), self.abs_floor))
        return self._scale

    def transform(self, X: np.ndarray, usable: np.ndarray) -> np.ndarray:
        """Standardize; cells not usable are 0 (the caller passes the mask along)."""
        Z = np.subtract(X, self.mean)
        Z /= self.scale()
        np.clip(Z, -self.clip, self.clip, out=Z)
        if not usable.all():
            Z[~usable] = 0.0
        return Z

    def update(self, X: np.ndarray, observed: np.ndarray) -> AffineChange | None:
        """Fold in the observed cells of the rows given; frozen dims are left alone."""
        if self._frozen:
            return None                      # the steady state: no dim learns any more
        learn = observed & (self.count < self.freeze_obs)
        nb = learn.sum(axis=0).astype(float)
        if not nb.any():
            self._frozen = bool((self.count >= self.freeze_obs).all())
            return None
        was_ready = self.ready()
        old_mean, old_scale = self.mean.copy(), self.scale()
        Xl = np.where(learn, X, 0.0)
        safe = np.maximum(nb, 1.0)
        bmean = Xl.sum(axis=0) / safe
        bm2 = (np.where(learn, X - bmean, 0.0) ** 2).sum(axis=0)
        tot = self.count + nb
        delta = bmean - self.mean
        upd = nb > 0
        self.mean = np.where(upd, self.mean + delta * nb / np.maximum(tot, 1.0), self.mean)
        self.m2 = np.where(upd, self.m2 + bm2 + delta ** 2 * self.count * nb / np.maximum(tot, 1.0), self.m2)
        self.count = tot
        self._scale = None
        new_scale = self.scale()
        a = old_scale / new_scale
        b = (old_mean - self.mean) / new_scale
        return AffineChange(a=a, b=b, moved=was_ready & upd, fresh=~was_ready & self.ready())

    def state(self) -> dict[str, np.ndarray]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load(self, arrays, dim: int) -> None:
        """arrays: a StateArrays; one value per feature each."""
        self.count, self.mean, self.m2 = (arrays.take(k, "f8", (dim,)) for k in ("count", "mean", "m2"))
        self._scale, self._frozen = None, False
