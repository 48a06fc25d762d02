"""The model's output, as diagnosis reads it: one flagged (rank, window)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping


@dataclass
class Anomaly:
    tenant: str
    job: str
    host: str
    rank: int
    window_start_ns: int
    score: float
    threshold: float
    detectors: list[str] = field(default_factory=list)        # "gmm", "peer", "hst", "mahalanobis"
    contributions: dict[str, float] = field(default_factory=dict)  # feature -> NLL contribution (top-k; > 0 = more anomalous)
    peer_z: dict[str, float] = field(default_factory=dict)    # feature -> signed robust z vs the job's median rank
    features: dict[str, float] = field(default_factory=dict)  # the window's vector; absent = masked
    role: str = ""                                            # culprit | waiting | node | job (model/roles.py)
    culprit_ranks: list[int] = field(default_factory=list)    # the job step's culprits, by rank

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Anomaly":
        """Build from a decoded message; unknown keys are an error, named."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"anomaly has unknown fields {unknown}; expected {sorted(names)}")
        missing = sorted(n for n in ("tenant", "job", "host", "rank", "window_start_ns", "score", "threshold")
                         if n not in d)
        if missing:
            raise ValueError(f"anomaly lacks fields {missing}")
        return cls(**{k: d[k] for k in names if k in d})
