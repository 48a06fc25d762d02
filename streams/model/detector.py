"""The one protocol every detector of the job model speaks, and the window it sees.

As river's estimators do, a detector learns from and scores a batch: here one
window of a job, every rank a row. The job model (job_model.py) loops over its
detectors; it knows none of them by name. What a detector declares:

- ``fixed_threshold``: None, and the job model flags the detector's scores
  against a DSPOT threshold of its own (learned, checkpointed with the model);
  or a number, and a score at or above it flags.
- ``admits_late``: it scores the admitted feature set (feature_admission.py),
  so while late features wait, shadow thresholds warm on its scores with them.
- ``explains``: the WindowScore field its per-feature explanation fills
  ("contributions" or "peer_z"), or None.

A new detector is one file with a class like these and one line in
detector_registry.py; ModelConfig fields only if it has settings.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from fleetscope.streams.model.scaling import AffineChange
from fleetscope.streams.model.top_features import TopFeatures


@dataclass(frozen=True)
class WindowCells:
    """One window's matrices (rows: ranks; columns: the job's features)."""
    X: np.ndarray           # raw values, NaN where masked
    observed: np.ndarray    # a value is present
    usable: np.ndarray      # present, and its feature has enough history to be standardized
    Z: np.ndarray           # standardized, 0 where not usable
    scored: np.ndarray      # the cells the admitted features cover (what admits_late detectors score)
    Zs: np.ndarray          # Z, 0 outside ``scored``
    compare: np.ndarray | None   # the admitted features (None: all), for decisions among established dims
    learn: bool             # False for a replayed window: score it, learn nothing from it
    shadow: bool = False    # these cells include late features: a shadow score, not the window's
    ranks: np.ndarray | None = None   # each row's rank (for detectors that keep per-rank state)
    warm: bool = False      # the job model is past its warm-up (its thresholds apply)

    def with_late_features(self, cells: np.ndarray, Zc: np.ndarray) -> "WindowCells":
        return replace(self, scored=cells, Zs=Zc, shadow=True)


class Detector(Protocol):
    name: str
    fixed_threshold: float | None
    admits_late: bool
    explains: str | None

    def grow(self, d: int, names: list[str]) -> None:
        """The job has ``d`` features now (``names`` in column order); new ones were appended."""

    def score(self, w: WindowCells) -> np.ndarray:
        """One score per row: higher is more anomalous."""

    def learn(self, w: WindowCells, weights: np.ndarray) -> None:
        """Learn the window; a row's weight is 1 when normal, less when flagged (0: not learned)."""

    def rescale(self, change: AffineChange) -> None:
        """The standardization moved (x' = a x + b on some dims): carry learned state across."""

    def explain(self, names: np.ndarray, k: int) -> TopFeatures | None:
        """Per-row top-k features of the last scored (non-shadow) window, if this detector explains."""

    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """JSON-able scalars and plain arrays (float64, int64, bool, uint8): nothing else is saved."""

    def load(self, meta: dict, arrays, dim: int) -> None:
        """Restore ``state()``; ``arrays`` is a StateArrays: take each with the dtype and shape expected."""

    def nbytes(self) -> int:
        """Bytes of learned state (memory accounting)."""
