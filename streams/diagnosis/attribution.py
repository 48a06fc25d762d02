"""From an anomaly's per-feature evidence to signed subsystem shares.

Two inputs, each normalized to sum 1 over the features it covers:
- the model's NLL contributions (clipped at 0: a negative contribution made
  the window look more normal, not less);
- the peer z-scores, by magnitude, counting only |z| >= z_floor (smaller
  deviations from the job's median rank are noise).
A feature's weight is alpha * contribution share + (1 - alpha) * peer share;
when only one input is present it carries the full weight.

Direction: a feature's sign is that of its peer z-score. A feature without
one at |z| >= z_floor (a single-rank job, or every rank moved together) has
no known direction, since the model's contribution carries none; it counts
as "up" and, when it leads its subsystem, that subsystem is marked unsigned
in the fingerprint (compared by magnitude only).

A subsystem's share is the sum of its features' weights (features never
cancel each other: clock down and temperature up are both GPU evidence), and
its sign is that of its heaviest feature, the subsystem's leading indicator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from fleetscope.streams.diagnosis.fingerprint import Fingerprint
from fleetscope.streams.diagnosis.subsystems import subsystem_of


@dataclass(frozen=True)
class FeatureShare:
    feature: str
    subsystem: str
    weight: float   # share of the anomaly, in [0, 1]
    sign: int       # +1 up, -1 down vs the job's peers
    signed: bool = True  # False: no peer z-score gave a direction (sign is +1 by convention)


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

    magnitude: dict[str, float] = {}
    leader: dict[str, FeatureShare] = {}
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
        signed = feature in peers
        sign = -1 if signed and z < 0 else 1
        fs = FeatureShare(feature, sub, weight, sign, signed)
        magnitude[sub] = magnitude.get(sub, 0.0) + weight
        if sub not in leader or weight > leader[sub].weight:  # features arrive sorted: ties keep the first name
            leader[sub] = fs
        features.append(fs)
    features.sort(key=lambda fs: (-fs.weight, fs.feature))
    shares = {sub: leader[sub].sign * m for sub, m in magnitude.items()}
    unsigned = [sub for sub, fs in leader.items() if not fs.signed]
    return Attribution(Fingerprint.from_shares(shares, unsigned), features[:top_k], unattributed)


def _finite(v) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def _normalized(weights: dict[str, float]) -> dict[str, float]:
    total = sum(weights.values())
    return {f: w / total for f, w in weights.items() if w > 0} if total > 0 else {}
