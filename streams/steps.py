"""Job steps: the windows of all of a job's ranks for one window start, released together.

The model scores a job's ranks side by side (peer comparison needs them all),
so a rank's closed window waits here until its step is complete: every rank
the job had in its previous step has arrived, or `hold_s` of wall time has
passed (a rank that stopped sending, or the job's very first step). Steps of
a job leave in window order; a ready step takes every earlier one with it.
Node windows (host counters) do not wait.

Waiting windows keep their messages unacknowledged, so a crash replays them.
"""
from __future__ import annotations

import time

from fleetscope.schema import NODE_TENANT

StepKey = tuple[str, str, int]  # tenant, job, window start


class JobSteps:
    def __init__(self, hold_s: float, clock=time.monotonic):
        self.hold_s = hold_s
        self.clock = clock
        self.pending: dict[StepKey, list] = {}
        self.first_seen: dict[StepKey, float] = {}
        self.members: dict[tuple[str, str], set[tuple[str, int]]] = {}  # (host, rank) of the last released step

    def admit(self, windows, force: bool = False) -> list:
        """Take closed windows; return those to store and score now."""
        now = self.clock()
        out = []
        for w in windows:
            if w.key[0] == NODE_TENANT:
                out.append(w)
                continue
            key = (w.key[0], w.key[1], w.start_ns)
            self.pending.setdefault(key, []).append(w)
            self.first_seen.setdefault(key, now)
        ready_upto: dict[tuple[str, str], int] = {}
        have = {key: {(w.key[2], w.key[3]) for w in ws} for key, ws in self.pending.items()}
        known = dict(self.members)
        for key in sorted(have):
            job = key[:2]
            expected = known.get(job)
            if expected is None:  # a job's first step: its ranks are complete once they all moved on
                expected = set().union(*(m for k, m in have.items() if k[:2] == job and k[2] > key[2])) or None
                expected = have[key] if expected is not None and have[key] >= expected else None
            if force or (expected and expected <= have[key]) or now - self.first_seen[key] >= self.hold_s:
                ready_upto[job] = max(ready_upto.get(job, key[2]), key[2])
                known[job] = have[key]
        for key in sorted(k for k in self.pending if k[:2] in ready_upto and k[2] <= ready_upto[k[:2]]):
            ws = self.pending.pop(key)
            del self.first_seen[key]
            self.members[key[:2]] = {(w.key[2], w.key[3]) for w in ws}
            out.extend(ws)
        return out

    def waiting_windows(self) -> int:
        return sum(len(ws) for ws in self.pending.values())
