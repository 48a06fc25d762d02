"""From an anomaly's per-feature evidence to signed subsystem shares.

Two inputs, each normalized to sum 1 over the features it covers:
- the model's NLL contributions (clipped at 0: a negative contribution made
  the window look more normal, not less);
- the peer z-scores, by magnitude, counting only |z| >= z_floor (smaller
  deviations from the job's median rank are noise).
A feature's weight is alpha * contribution share + (1 - alpha) * peer share;
when only one input is present it carries the full weight.

Direction: the sign of the feature's peer z-score. A feature with no peer
z-score (a single-rank job, or every rank moved together) counts as "up",
since the model's contribution has no direction of its own.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from streams.diagnosis.fingerprint import Fingerprint
from streams.diagnosis.subsystems import subsystem_of


@dataclass(frozen=True)
class FeatureShare:
    feature: str
    subsystem: str
    weight: float   # share of the anomaly, in [0, 1]
    sign: int       # +1 up, -1 down vs the job's peers


@dataclass
class Attribution:
    fingerprint: Fingerprint
    top: list[FeatureShare] = field(default_factory=list)   # by weight, largest first
    unattributed: list[str] = field(default_factory=list)   # features with no subsystem


def attribute(contributions: Mapping[str, float], peer_z: Mapping[str, float],
              alpha: float = 0.5, z_floor: float = 1.0, top_k: int = 8) -> Attribution:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    contrib = _normalized({f: max(0.0, v) for f, v in contributions.items() if _finite(v)})
    peers = _normalized({f: abs(z) for f, z in peer_z.items() if _finite(z) and abs(z) >= z_floor})
    a = alpha if contrib and peers else (1.0 if contrib else 0.0)

    shares: dict[str, float] = {}
    features: list[FeatureShare] = []
    unattributed: list[str] = []
    for feature in sorted(set(contrib) | set(peers)):
        weight = a * contrib.get(feature, 0.0) + (1.0 - a) * peers.get(feature, 0.0)
        if weight <= 0:
            continue
        sub = subsystem_of(feature)
        if sub is None:
            unattributed.append(feature)
            continue
        z = peer_z.get(feature, 0.0)
        sign = -1 if _finite(z) and z < 0 else 1
        shares[sub] = shares.get(sub, 0.0) + sign * weight
        features.append(FeatureShare(feature, sub, weight, sign))
    features.sort(key=lambda fs: (-fs.weight, fs.feature))
    return Attribution(Fingerprint.from_shares(shares), features[:top_k], unattributed)


def _finite(v) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def _normalized(weights: dict[str, float]) -> dict[str, float]:
    total = sum(weights.values())
    return {f: w / total for f, w in weights.items() if w > 0} if total > 0 else {}
