"""Which detectors decide: a k-of-n vote over a named set.

Rule strings:
    "gmm or peer"            any of them        (k = 1)
    "gmm and peer"           all of them        (k = n)
    "2 of gmm,peer,hst"      at least k of them
    "gmm"                    that one alone
Detector names: those of detector_registry.REGISTRY (gmm, peer, hst, mahalanobis).
"""
from __future__ import annotations

from dataclasses import dataclass

from fleetscope.streams.model.detector_registry import REGISTRY

DETECTORS = tuple(REGISTRY)


@dataclass(frozen=True)
class Rule:
    names: tuple[str, ...]
    k: int

    @classmethod
    def parse(cls, text: str) -> "Rule":
        t = text.strip().lower()
        if " of " in t:
            k_text, rest = t.split(" of ", 1)
            names = tuple(n.strip() for n in rest.split(","))
            k = int(k_text)
        elif " and " in t:
            names = tuple(n.strip() for n in t.split(" and "))
            k = len(names)
        else:
            names = tuple(n.strip() for n in t.split(" or "))
            k = 1
        unknown = [n for n in names if n not in DETECTORS]
        if unknown or not names:
            raise ValueError(f"ensemble rule {text!r}: unknown detector(s) {unknown}; known: {DETECTORS}")
        if not 1 <= k <= len(names):
            raise ValueError(f"ensemble rule {text!r}: k={k} must be between 1 and {len(names)}")
        return cls(names, k)

    def decide(self, fired: set[str]) -> bool:
        return sum(n in fired for n in self.names) >= self.k
