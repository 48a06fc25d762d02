"""An anomaly's id: TENANT/JOB/RANK/WINDOW_START_NS, the key of its row in the anomalies table.

It is what the alerts carry (the Alertmanager annotation `anomaly_id`) and what `fleetscope trace --anomaly`
takes. A job's name may itself hold "/", so the id is read from both ends: the tenant is the first part, the
rank and window start the last two, and the job everything between.
"""
from __future__ import annotations

from dataclasses import dataclass

FORMAT = "TENANT/JOB/RANK/WINDOW_START_NS"


@dataclass(frozen=True)
class AnomalyId:
    tenant: str
    job: str
    rank: int
    window_start_ns: int

    def __str__(self) -> str:
        return f"{self.tenant}/{self.job}/{self.rank}/{self.window_start_ns}"


def parse_anomaly_id(text: str) -> AnomalyId:
    """The id's parts; ValueError saying what is wrong with it."""
    parts = text.split("/")
    if len(parts) < 4 or not parts[0] or not all(parts[1:-2]):
        raise ValueError(f"anomaly id {text!r} is not {FORMAT}")
    try:
        rank, window_ns = int(parts[-2]), int(parts[-1])
    except ValueError:
        raise ValueError(f"anomaly id {text!r}: RANK and WINDOW_START_NS must be integers ({FORMAT})") from None
    if window_ns <= 0:
        raise ValueError(f"anomaly id {text!r}: WINDOW_START_NS must be positive (ns since the Unix epoch)")
    return AnomalyId(parts[0], "/".join(parts[1:-2]), rank, window_ns)
