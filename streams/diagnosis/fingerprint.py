"""A window's fingerprint: signed subsystem shares in a fixed order.

Each entry is the share of the anomaly that one subsystem carries, signed by
the direction its features moved (+ up, - down). The absolute values sum to
1 (or all are 0 when nothing was attributed). A subsystem whose direction
is unknown (its leading feature moved with every rank of the job, so there
is no peer z-score to sign it) is marked in `unsigned`; comparisons then use
its magnitude only: where the anomaly is, not which way it went. Because the inputs are
unitless (NLL contributions of standardized features, robust peer
z-scores) and the vector is L1-normalized, fingerprints from different jobs
and different hardware are directly comparable.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from fleetscope.streams.diagnosis.subsystems import SUBSYSTEMS


@dataclass(frozen=True)
class Fingerprint:
    values: tuple[float, ...]           # one per SUBSYSTEMS entry, same order
    unsigned: frozenset[str] = frozenset()  # subsystems whose direction is unknown

    def __post_init__(self) -> None:
        if len(self.values) != len(SUBSYSTEMS):
            raise ValueError(f"a fingerprint has {len(SUBSYSTEMS)} values, got {len(self.values)}")
        unknown = set(self.unsigned) - set(SUBSYSTEMS)
        if unknown:
            raise ValueError(f"unsigned names unknown subsystems {sorted(unknown)}")

    @classmethod
    def from_shares(cls, shares: Mapping[str, float], unsigned=()) -> "Fingerprint":
        """Normalize signed subsystem weights (any scale) to a fingerprint."""
        vec = _l1(_vector(shares, "shares"))
        return cls(vec, frozenset(s for s in unsigned if vec[SUBSYSTEMS.index(s)]))

    def as_dict(self) -> dict[str, float]:
        return dict(zip(SUBSYSTEMS, self.values))

    def dominant(self) -> str | None:
        """The subsystem with the largest share, or None for an empty fingerprint."""
        best = max(range(len(self.values)), key=lambda i: abs(self.values[i]))
        return SUBSYSTEMS[best] if self.values[best] else None

    def is_empty(self) -> bool:
        return not any(self.values)


def pattern_vector(pattern: Mapping[str, float], where: str = "pattern") -> tuple[float, ...]:
    """A KB fingerprint pattern ({subsystem: signed weight}) as a normalized vector."""
    vec = _l1(_vector(pattern, where))
    if not any(vec):
        raise ValueError(f"{where}: a fingerprint pattern needs at least one non-zero subsystem weight")
    return vec


def similarity(a: Fingerprint | tuple[float, ...], b: Fingerprint | tuple[float, ...]) -> float:
    """Cosine similarity in [-1, 1]; 0 when either side is empty.

    Signs matter: a GPU slowdown (gpu_compute down) and a GPU surge
    (gpu_compute up) point in opposite directions. Where either side's
    direction is unknown, that subsystem compares by magnitude.
    """
    va, ua = (a.values, a.unsigned) if isinstance(a, Fingerprint) else (a, frozenset())
    vb, ub = (b.values, b.unsigned) if isinstance(b, Fingerprint) else (b, frozenset())
    na = math.sqrt(sum(x * x for x in va))
    nb = math.sqrt(sum(x * x for x in vb))
    if na == 0 or nb == 0:
        return 0.0
    unsigned = ua | ub
    dot = sum(abs(x * y) if sub in unsigned else x * y for sub, x, y in zip(SUBSYSTEMS, va, vb))
    return max(-1.0, min(1.0, dot / (na * nb)))


def _vector(shares: Mapping[str, float], where: str) -> list[float]:
    unknown = sorted(set(shares) - set(SUBSYSTEMS))
    if unknown:
        raise ValueError(f"{where}: unknown subsystems {unknown}; known: {list(SUBSYSTEMS)}")
    out = []
    for sub in SUBSYSTEMS:
        v = float(shares.get(sub, 0.0))
        if not math.isfinite(v):
            raise ValueError(f"{where}: {sub} = {v} is not finite")
        out.append(v)
    return out


def _l1(vec: list[float]) -> tuple[float, ...]:
    total = sum(abs(v) for v in vec)
    return tuple(v / total for v in vec) if total > 0 else tuple(0.0 for _ in vec)
