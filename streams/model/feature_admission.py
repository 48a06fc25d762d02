"""Which features the score detectors use, and the gate that lets a late feature in.

A score detector's threshold is calibrated on scores over a set of features.
The mixture NLL is a sum of per-feature terms, so a feature that becomes
usable after calibration (a tracer that attached late, a source that started
reporting) adds its term to every rank at once and the whole job crosses the
old threshold together: measured in the CI straggler scenario, where a late
torch tracer flagged every rank until the regime rule relearned (20 windows).

So the scored set is fixed when the thresholds start to warm (the second half
of warm-up). A feature that becomes usable after that is *pending*:
 - the mixture learns it from then on (its responsibilities come from the
   scored features only, so a new, still unfitted dimension cannot move the
   established components), but the score leaves it out;
 - for ``rejoin_windows`` windows a shadow threshold per detector warms on
   the scores with the pending features included (second half, unflagged
   rows only: the same shape as the warm-up);
 - then the shadow thresholds calibrate and replace the current ones, and the
   pending features join the scored set (``stats['features_admitted']``).
Features that become usable while a round runs wait for the next round.
Only quiet windows, where no rank is flagged, count toward a round (JobModel
skips the others, ``stats['admission_windows_skipped']``): a fault changes its
peers' scores too, and a round that ran during one calibrated the new
thresholds on the fault. Measured on the dev scenario ``dataloader_stall``:
torch features that became usable as the stall began were admitted five
windows before it ended, on 10 scores of the stalled job, and every rank was
then flagged for 24 windows after the job had recovered. A job that always
has a flagged rank keeps its late features pending: learned, not scored.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from fleetscope.streams.model.threshold import DSpot


class FeatureAdmission:
    def __init__(self, make_threshold: Callable[[], DSpot], rejoin_windows: int, detectors: list[str]):
        self.make_threshold = make_threshold
        self.rejoin_windows = rejoin_windows
        self.detectors = detectors              # the score detectors whose thresholds a round replaces
        self.scored: np.ndarray | None = None   # None: warm-up's first half, every usable feature scores
        self.pending = np.zeros(0, bool)
        self.windows = 0                        # windows of the current round
        self.shadow: dict[str, DSpot] = {}

    def grow(self, d: int) -> None:
        extra = d - self.pending.size
        if extra > 0:
            self.pending = np.concatenate([self.pending, np.zeros(extra, bool)])
            if self.scored is not None:
                self.scored = np.concatenate([self.scored, np.zeros(extra, bool)])

    @property
    def active(self) -> bool:
        return bool(self.pending.any())

    def fix(self, ready: np.ndarray) -> None:
        """Thresholds start to warm: the features usable now are the scored set."""
        if self.scored is None:
            self.scored = ready.copy()

    def mask(self, usable: np.ndarray) -> np.ndarray:
        """The cells the score detectors use."""
        if self.scored is None or self.scored.all():
            return usable
        return usable & self.scored

    def extended(self, usable: np.ndarray) -> np.ndarray:
        """The cells of the scored and the pending features (the shadow thresholds' scores)."""
        return usable & (self.scored | self.pending)

    def begin(self, ready: np.ndarray) -> None:
        """Start a round when features became usable outside the scored set."""
        if self.scored is None or self.active:
            return
        new = ready & ~self.scored
        if new.any():
            self.pending = new
            self.windows = 0
            self.shadow = {name: self.make_threshold() for name in self.detectors}

    def observe(self, scores: dict[str, np.ndarray]) -> None:
        """One window of the round: the shadow thresholds warm on its second half (normal rows' scores)."""
        self.windows += 1
        if self.windows > self.rejoin_windows // 2:
            for name, s in scores.items():
                self.shadow[name].warm(s)

    def admit(self, thresholds: dict[str, DSpot], calibrated: bool) -> int:
        """End the round if it is due: shadow thresholds replace the current ones. Returns the features admitted."""
        if not self.active or self.windows < self.rejoin_windows or not calibrated:
            return 0
        if any(t.init.size < 10 for t in self.shadow.values()):
            return 0          # too few normal rows yet: keep warming
        for name, t in self.shadow.items():
            t.calibrate()
            thresholds[name] = t
        n = int(self.pending.sum())
        self.scored |= self.pending
        self.pending = np.zeros_like(self.pending)
        self.shadow = {}
        return n

    # ----------------------------------------------------------- checkpoint
    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        meta = {"windows": self.windows, "fixed": self.scored is not None, "shadow": {}}
        arrays = {"pending": self.pending}
        if self.scored is not None:
            arrays["scored"] = self.scored
        for name, t in self.shadow.items():
            meta["shadow"][name], a = t.state()
            arrays.update({f"{name}/{k}": v for k, v in a.items()})
        return meta, arrays

    def load(self, meta: dict, arrays, dim: int) -> None:
        """arrays: a StateArrays; masks of ``dim`` features, shadow thresholds of known detectors only."""
        self.windows = arrays.count(meta, "windows", 1 << 62)
        self.pending = arrays.take("pending", "b1", (dim,))
        self.scored = arrays.take("scored", "b1", (dim,)) if arrays.flag(meta, "fixed") else None
        self.shadow = {}
        for name, m in arrays.mapping(meta, "shadow").items():
            if name not in self.detectors:
                arrays.fail(f"shadow: {name!r} is not one of {self.detectors}")
            t = self.make_threshold()
            t.load(m, arrays.part(name))
            self.shadow[name] = t
