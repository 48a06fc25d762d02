"""ModelConfig and WindowScore: the job model's settings and its per-rank output."""
from __future__ import annotations

from dataclasses import dataclass, field

from streams.model.ensemble import DETECTORS, Rule


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
    anomaly_weight: float = 0.0       # learning weight of a flagged row (0: not learned)
    regime_windows: int = 20          # most ranks flagged this many windows in a row: learn it as the new normal
    # peers
    peer_z_threshold: float = 6.0
    peer_min_ranks: int = 3
    peer_rel_floor: float = 0.02
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
        unknown = [d for d in self.detectors if d not in DETECTORS]
        if unknown:
            raise ValueError(f"unknown detector(s) {unknown}; known: {DETECTORS}")
        if "gmm" not in self.detectors:
            raise ValueError("the 'gmm' detector always runs (it is the score); keep it in detectors")
        missing = [n for n in Rule.parse(self.rule).names if n not in self.detectors]
        if missing:
            raise ValueError(f"rule {self.rule!r} uses detector(s) {missing} that are not in detectors={self.detectors}")


@dataclass
class WindowScore:
    rank: int
    score: float                      # mixture negative log-likelihood of the observed features
    threshold: float | None           # mixture alarm threshold; None during warm-up
    is_anomaly: bool                  # the ensemble rule's decision
    detectors: list[str] = field(default_factory=list)         # which detectors fired
    contributions: dict[str, float] = field(default_factory=dict)  # top-k features by NLL term
    peer_z: dict[str, float] = field(default_factory=dict)     # top-k features by |robust z|
    warm: bool = False                # past warm-up: thresholds apply
