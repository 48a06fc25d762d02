"""ModelConfig and WindowScore: the job model's settings and its per-rank output."""
from __future__ import annotations

from dataclasses import dataclass

from fleetscope.streams.model.detector_registry import PRIMARY
from fleetscope.streams.model.ensemble import DETECTORS, Rule


LIMITS = {"max_features": 4096, "k": 64, "max_components": 64, "dspot_depth": 1_000_000, "hst_trees": 100,
          "hst_height": 12, "hst_window": 1_000_000, "top_k": 4096, "warmup_windows": 1_000_000,
          "peer_offset_min_obs": 1_000_000}


@dataclass
class ModelConfig:
    # mixture
    covariance: str = "diag"          # "diag" or "full" (shrunk toward the diagonal)
    k: int | None = None              # None: grown and merged online up to max_components
    max_components: int = 8
    alpha: float = 0.6                # stepwise-EM step (t + 2) ** -alpha, alpha in (0.5, 1]
    eta_min: float = 0.02             # step floor: memory of ~1/eta_min windows, follows drift
    var_floor: float = 1e-2           # in standardized units
    shrinkage: float = 0.1            # full covariance: weight of the diagonal target
    spawn_p: float = 1e-4             # a row beyond this chi-square tail spawns a component
    merge_bd: float = 0.02            # merge components closer than this (per-dim Bhattacharyya)
    # features
    max_features: int = 256           # beyond: new names are counted and ignored
    scaler_min_obs: int = 8           # a feature is used once it has this many observations
    scaler_freeze_obs: int = 256      # ... and its standardization is frozen after this many
    # thresholds
    warmup_windows: int = 30          # no flags before this many windows; thresholds calibrate on the second half
    risk: float = 5e-4                # DSPOT: tail probability of an alarm, per score
    tail_level: float = 0.9           # DSPOT: initial quantile that defines the peaks (low: few warm-up scores)
    dspot_depth: int = 200            # DSPOT: scores in the moving level (0: plain SPOT)
    warm_detrend: bool = True         # DSPOT: cap warm-up outliers around the warm-up's trend, not its median
    tail_uncertainty: float = 1.0     # DSPOT: widen the tail's scale by (1 + this / sqrt(peaks)), its standard
                                      # error: from a 45-score warm-up plain DSPOT alarmed at ~4x its risk (simulated)
    anomaly_weight: float = 0.0       # learning weight of a flagged row (0: not learned)
    regime_windows: int = 20          # most ranks flagged this many windows in a row: learn it as the new normal
    phase_windows: int = 2            # most ranks flagged at most this many windows in a row, then not: a phase
                                      # the job went through (a checkpoint, an evaluation pass), learned once over
                                      # (0: never); a repeating one becomes a component of the mixture
    slowdown_regime_windows: int = 300  # the job's rate or OFU below its history this many windows in a row: its
                                      # new normal (job_rate.py). Until then a slowdown stays flagged: at 20, a
                                      # dev job_wide_slowdown's alarm ended 20 s into its 40 s at -41%
    rejoin_windows: int = 20          # a feature usable only after thresholds started warming joins the score
                                      # after this many windows, with thresholds recalibrated (FeatureAdmission)
    # peers
    peer_z_threshold: float = 6.0
    peer_min_ranks: int = 3
    peer_rel_floor: float = 0.02
    window_s: float = 0.0             # the windows' length: the peers' floor of one event or clock tick per
                                      # window (peers.resolution_step); 0: unknown, no such floor
    peer_offset_rate: float = 0.02    # each rank's usual offset from its peers (peers.RankOffsets): cumulative
                                      # mean over its first 1/rate windows, then this rate; 0: no offsets
    peer_offset_min_obs: int = 8      # ... used once a rank's feature has this many windows (before: plain peer z)
    # ensemble
    detectors: tuple[str, ...] = ("gmm", "peer", "mahalanobis", "hst")   # which run
    rule: str = "gmm or peer"                                            # which decide
    hst_trees: int = 10
    hst_height: int = 8
    hst_window: int = 100
    # output
    top_k: int = 5
    seed: int = 0

    def __post_init__(self):
        self.detectors = tuple(self.detectors)
        for name, most in LIMITS.items():   # sizes that become allocations: bounded (a checkpoint carries them)
            value = getattr(self, name)
            if value is not None and not 0 <= value <= most:
                raise ValueError(f"{name}={value!r} must be between 0 and {most}")
        if not 0.0 <= self.peer_offset_rate <= 1.0:
            raise ValueError(f"peer_offset_rate={self.peer_offset_rate!r} must be between 0 and 1")
        unknown = [d for d in self.detectors if d not in DETECTORS]
        if unknown:
            raise ValueError(f"unknown detector(s) {unknown}; known: {DETECTORS}")
        if PRIMARY not in self.detectors:
            raise ValueError(f"the {PRIMARY!r} detector always runs (it is the score); keep it in detectors")
        missing = [n for n in Rule.parse(self.rule).names if n not in self.detectors]
        if missing:
            raise ValueError(f"rule {self.rule!r} uses detector(s) {missing} that are not in detectors={self.detectors}")


class WindowScore:
    """One rank's result for one window.

    ``contributions`` (top-k features by NLL term) and ``peer_z`` (top-k by
    |robust z|) are dicts; the job model passes them as a window's
    ``TopFeatures`` and they are ranked when first read (only flagged rows'
    usually are).
    """
    __slots__ = ("rank", "score", "threshold", "is_anomaly", "detectors", "warm", "_contrib", "_peer", "_row")

    def __init__(self, rank: int, score: float, threshold: float | None, is_anomaly: bool,
                 detectors: list[str] | None = None, contributions=None, peer_z=None, warm: bool = False,
                 row: int = 0):
        self.rank = rank
        self.score = score                    # mixture negative log-likelihood of the observed features
        self.threshold = threshold            # mixture alarm threshold; None during warm-up
        self.is_anomaly = is_anomaly          # the ensemble rule's decision
        self.detectors = [] if detectors is None else detectors   # which detectors fired
        self.warm = warm                      # past warm-up: thresholds apply
        self._contrib = {} if contributions is None else contributions
        self._peer = {} if peer_z is None else peer_z
        self._row = row                       # this rank's row in a TopFeatures

    @property
    def contributions(self) -> dict[str, float]:
        c = self._contrib
        return c if isinstance(c, dict) else c.row(self._row)

    @property
    def peer_z(self) -> dict[str, float]:
        p = self._peer
        return p if isinstance(p, dict) else p.row(self._row)

    def __eq__(self, other) -> bool:
        if not isinstance(other, WindowScore):
            return NotImplemented
        return all(getattr(self, a) == getattr(other, a) for a in
                   ("rank", "score", "threshold", "is_anomaly", "detectors", "warm", "contributions", "peer_z"))

    def __repr__(self) -> str:
        return (f"WindowScore(rank={self.rank}, score={self.score!r}, threshold={self.threshold!r}, "
                f"is_anomaly={self.is_anomaly}, detectors={self.detectors}, warm={self.warm})")
