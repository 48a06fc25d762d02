"""Who is to blame in a job step: a role for every flagged rank-window.

In a synchronous job one slow rank makes every peer wait for it in the next
collective, so the model flags the culprit and its waiting peers alike.
Collective durations do not tell them apart (synchronisation evens them out);
how long each rank *waited* does: the rank that arrives last waits least.

The wait share, in order of preference: ``arrival_wait_frac`` (NCCL jobs
whose communicators' init was traced, and gloo jobs: the time each rank
entered its collectives before the last rank did, from the communicators'
sequence numbers, streams/arrival.py: who arrives last, not how long a call took),
``nccl_time_frac`` (time inside NCCL calls) or, without NCCL,
``torch_comm_wait_frac`` (gloo: threads blocked waiting for peers). Per step,
over the job's flagged ranks:

- the flagged rank that waits least is a ``culprit``, and so is every flagged
  rank that waits about as little (two slow ranks are two culprits);
- a flagged rank that waits clearly more than the least-waiting culprit is
  ``waiting``: visible in scores, but no alert;
- when the ranks carry no wait share (one rank, no collectives) every flagged
  rank is a culprit: nothing says it waits for another.

When every flagged rank waits, and an unflagged rank of the same step waits
clearly less than all of them, that rank is what they wait for: it is promoted
to a flagged culprit (the model saw the symptom on its peers, not on it).

Roles ``node`` and ``job`` come from the node and job detectors, not from here.
When the job's own rate says its iterations slowed, ``differs_from_peers`` and
``explains_slowdown`` tell the job detector whether the step's culprits are
really what the others wait for, or whether every rank slowed and one merely
arrived last.
"""
from __future__ import annotations

import math
from statistics import median
from dataclasses import dataclass
from typing import Mapping, Sequence

CULPRIT, WAITING, NODE, JOB = "culprit", "waiting", "node", "job"
ROLES = (CULPRIT, WAITING, NODE, JOB)
# Which share says "time spent waiting for peers", in order of preference: measured from the order of
# arrival at each collective; else a job with NCCL waits in NCCL; a CPU job's gloo waits are in c10d's
# wait probes.
ARRIVAL_WAIT = "arrival_wait_frac"
WAIT_FEATURES = (ARRIVAL_WAIT, "nccl_time_frac", "torch_comm_wait_frac")
# "Clearly more": a rank waits at least this much longer (share of its window), and at least this
# fraction of its own wait longer, than the least-waiting culprit. Healthy ranks of one job differ
# by a few points of share; a straggler's peers by tens (e.g. 0.33 against 0.06).
MIN_GAP = 0.03
MIN_REL_GAP = 0.2
# The order of arrival alone names a rank the cause of a job-wide slowdown only when its peers wait for it.
# When one rank makes every iteration take r times as long, a peer can wait up to 1 - 1/r of its window at
# entry for it; gloo's ring also waits inside the call, so a real straggler shows less (the dev straggler, r
# 2.5-3.2: 0.17-0.32 of that). When every rank slowed itself (a CPU quota on each, dev scenario
# job_wide_slowdown, r 1.5-2.1), the rank that happens to arrive last leads by 0.17-0.40 of it. Half is the line;
# a straggler its own model or the peer comparison flags needs no arrival order (differs_from_peers).
EXPLAINED_SHARE = 0.5
# Iterations at most this much longer than the job's own history: no job-wide slowdown to explain.
MIN_SLOWDOWN = 1.1


@dataclass(frozen=True)
class StepRoles:
    roles: list[str]          # per row: "" (not flagged) or one of ROLES
    promoted: list[int]       # row indices flagged here (the unflagged rank the others wait for)
    wait_feature: str | None  # the share that decided, None when no row carried one
    culprit_ranks: list[int]  # the step's culprits, by rank


def wait_feature(vectors: Sequence[Mapping[str, float]]) -> str | None:
    """The wait share this step can compare: the first of WAIT_FEATURES that two ranks report."""
    for name in WAIT_FEATURES:
        if sum(1 for v in vectors if finite(v.get(name))) >= 2:
            return name
    return None


def wait_shares(vectors: Sequence[Mapping[str, float]], name: str | None) -> list[float | None]:
    """Each row's wait share ``name``, None where the row has no finite one (or no share was chosen)."""
    return [float(v[name]) if name is not None and finite(v.get(name)) else None for v in vectors]


def waits_clearly_more(wait: float, least: float) -> bool:
    gap = wait - least
    return gap >= MIN_GAP and gap >= MIN_REL_GAP * wait


def assign_roles(ranks: Sequence[int], vectors: Sequence[Mapping[str, float]],
                 flagged: Sequence[bool]) -> StepRoles:
    """Roles for one job step: rows are (rank, the rank's feature vector, flagged by the model)."""
    n = len(ranks)
    roles = ["" for _ in range(n)]
    flagged_rows = [i for i in range(n) if flagged[i]]
    if not flagged_rows:
        return StepRoles(roles, [], None, [])
    name = wait_feature(vectors)
    waits = wait_shares(vectors, name)
    measured = [i for i in flagged_rows if waits[i] is not None]
    promoted: list[int] = []
    if measured:
        least = min(waits[i] for i in measured)
        idle = [i for i in range(n) if not flagged[i] and waits[i] is not None]
        if idle:  # does every flagged rank wait for a rank the model left alone?
            j = min(idle, key=lambda i: waits[i])
            if all(waits_clearly_more(waits[i], waits[j]) for i in measured):
                promoted, least = [j], waits[j]
                roles[j] = CULPRIT
        for i in measured:
            roles[i] = WAITING if waits_clearly_more(waits[i], least) else CULPRIT
    for i in flagged_rows:
        if waits[i] is None:
            roles[i] = CULPRIT
    culprits = sorted(int(ranks[i]) for i in range(n) if roles[i] == CULPRIT)
    return StepRoles(roles, promoted, name, culprits)


def last_arrivers(vectors: Sequence[Mapping[str, float]]) -> list[int] | None:
    """The rows that arrived last at the step's collectives, when arrival order names at most half of them.

    A job-wide change (its collective rate fell) that every rank's model saw alike, or none did, is still
    one rank's doing when its peers clearly wait for it at each collective (ARRIVAL_WAIT): those ranks are
    the culprits and the rest waiting. Only the order of arrival decides this, not the time inside calls,
    which a slow link or a busy host raises for every rank. None when fewer than two ranks were compared,
    when no rank waits clearly more than the last arriver, or when more than half arrive alike last.
    """
    waits = wait_shares(vectors, ARRIVAL_WAIT)
    measured = [i for i, w in enumerate(waits) if w is not None]
    if len(measured) < 2:
        return None
    least = min(waits[i] for i in measured)
    late = [i for i in measured if not waits_clearly_more(waits[i], least)]
    if len(late) == len(measured) or 2 * len(late) > len(vectors):
        return None
    return late


# Detectors whose flag says a rank differs from its peers in this step, not only from its own past.
PEER_DETECTORS = ("peer", "wait")


def differs_from_peers(detectors: Sequence[str]) -> bool:
    """A culprit its peers' comparison flagged (or promoted as the rank every flagged peer waited for).

    Only such a culprit explains a slowdown of the whole job. One that only its own history flagged, like
    its peers, is a rank whose job slowed around it (dev scenario job_wide_slowdown: every rank flagged by its
    own mixture, and the one that waited least named the culprit in 33 of 40 windows; every straggler
    culprit of the dev runs was flagged by the peer comparison)."""
    return any(d in PEER_DETECTORS for d in detectors)


def explains_slowdown(vectors: Sequence[Mapping[str, float]], rows: Sequence[int],
                      iteration_time_ratio: float | None) -> bool:
    """Do these rows (the step's last arrivers) account for the job's slower iterations?

    Yes when their peers wait for them by at least EXPLAINED_SHARE of what a slowdown of
    ``iteration_time_ratio`` (the job's iteration time against its own history, model/job_rate.py) would
    make them wait, 1 - 1/r of a window: the median peer's wait share minus the rows' largest. No when the
    peers barely wait longer: every rank slowed down, and the rows only happened to arrive last. Yes
    (nothing to decide against) without a slowdown of at least MIN_SLOWDOWN or without wait shares.
    """
    if not finite(iteration_time_ratio) or iteration_time_ratio < MIN_SLOWDOWN:
        return True
    name = wait_feature(vectors)
    if name is None:
        return True
    waits = wait_shares(vectors, name)
    chosen = set(rows)
    own = [waits[i] for i in chosen if waits[i] is not None]
    peers = [w for i, w in enumerate(waits) if i not in chosen and w is not None]
    if not own or not peers:
        return True
    return median(peers) - max(own) >= EXPLAINED_SHARE * (1 - 1 / iteration_time_ratio)


def finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)
