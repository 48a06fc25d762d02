"""The scenario clock's window grid, shared by the runner, the fingerprint metrics and replay.

A run's window k is [t0 + k*window_s, t0 + (k+1)*window_s) in event time (t0: the first window
boundary after the job's model is warm). Scoring grace: the window holding a fault's start may
or may not see it (it can start mid-window), and the effect outlives the fault by a window
while queues drain.
"""
from __future__ import annotations

ONSET_GRACE_WINDOWS = 1
RECOVERY_GRACE_WINDOWS = 2


def ns(t: float) -> int:
    return int(round(t * 1e9))


def window_of(ns_since_epoch: int, t0: float, window_s: float) -> int:
    """The grid window of a stored window_start (nanoseconds since the epoch)."""
    return int(round((ns_since_epoch - ns(t0)) / ns(window_s)))


def grace(window_s: float) -> dict:
    return dict(onset_grace_s=ONSET_GRACE_WINDOWS * window_s, recovery_grace_s=RECOVERY_GRACE_WINDOWS * window_s)
