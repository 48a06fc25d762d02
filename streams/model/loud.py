"""Loud failures, alerted in the window they appear, without waiting for a model to learn them.

Per job step (all ranks of one window, each vector joined with its node and
GPU, see streams/rank_context.py):

- ``xid``: the rank's GPU raised an Xid (``gpu_xid_count`` >= 1);
- ``ecc``: its GPU reported a double-bit ECC event, or its count of
  uncorrected ECC errors or of rows pending/failing remap grew since the
  previous window (``gpu_ecc_new_errors``; the counts are cumulative, so a
  value that merely stays non-zero is not new);
- ``vanished``: a rank of the previous step sent nothing in this one while
  others of its job did (a crashed or killed rank); it gets a row of its own
  with ``rank_vanished`` = 1. The window it died in is the first one missing:
  that window stays open for late rows, so the step goes on without it once
  ``step_hold_s`` has passed. A step older than the job's newest (such a
  window, closed later by ``idle_close_s``) changes no membership;
- ``hung``: every rank that had been completing collectives (NCCL calls, or
  gloo waits) for ``history`` windows completed none in this window: the
  tracers report a call when it returns, so a call stuck in flight reads as
  silence. The stuck rank cannot be told from the ones it blocks with these
  features (that needs each rank's stack, or a per-communicator sequence
  number in the probes), so every rank gets role ``job``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

CALL_RATES = ("nccl_calls_per_s", "torch_comm_waits_per_s")
ECC_COUNTS = ("gpu_ecc_uncorrected", "gpu_row_remap_pending")
KIND_FEATURE = {"xid": "gpu_xid_count", "ecc": "gpu_ecc_new_errors", "vanished": "rank_vanished",
                "hung": "collective_stalled"}


@dataclass
class LoudFlag:
    index: int | None          # the step row it concerns; None for a vanished rank (no row)
    host: str
    rank: int
    kind: str                  # xid | ecc | vanished | hung
    features: dict[str, float] = field(default_factory=dict)


class LoudFailures:
    def __init__(self, history: int = 3):
        self.history = history
        self.members: dict[tuple[str, str], set[tuple[str, int]]] = {}
        self.newest: dict[tuple[str, str], int] = {}               # the job's newest step start
        self.calling: dict[tuple[str, str, str, int], int] = {}   # windows in a row with completed collectives
        self.ecc_seen: dict[tuple[str, int], float] = {}            # (host, rank) -> its GPU's last cumulative count
        self.counts = {"xid": 0, "ecc": 0, "vanished": 0, "hung": 0}

    def step(self, job: tuple[str, str], start_ns: int, members: Sequence[tuple[str, int]],
             vectors: Sequence[Mapping[str, float]]) -> list[LoudFlag]:
        flags: list[LoudFlag] = []
        late = start_ns <= self.newest.get(job, -1)
        for i, ((host, rank), v) in enumerate(zip(members, vectors)):
            if _num(v.get("gpu_xid_count")) >= 1:
                flags.append(LoudFlag(i, host, rank, "xid"))
            new = self._new_ecc(host, rank, v)
            if new > 0 or _num(v.get("gpu_ecc_dbe_count")) >= 1:
                flags.append(LoudFlag(i, host, rank, "ecc", {"gpu_ecc_new_errors": max(new, 0.0)
                                                             + _num(v.get("gpu_ecc_dbe_count"))}))
        if late:   # a late or replayed step: its hardware events count, its membership and silence do not
            return self._count(flags)
        self.newest[job] = start_ns
        present = set(members)
        before = self.members.get(job)
        if before and present:
            flags += [LoudFlag(None, host, rank, "vanished", {"rank_vanished": 1.0})
                      for host, rank in sorted(before - present)]
        self.members[job] = present
        flags += self._hung(job, members, vectors)
        return self._count(flags)

    def _count(self, flags: list[LoudFlag]) -> list[LoudFlag]:
        for f in flags:
            self.counts[f.kind] += 1
        return flags

    def _new_ecc(self, host: str, rank: int, v: Mapping[str, float]) -> float:
        total = sum(_num(v.get(name)) for name in ECC_COUNTS if name in v)
        if not any(name in v for name in ECC_COUNTS):
            return 0.0
        last = self.ecc_seen.get((host, rank))
        self.ecc_seen[(host, rank)] = total
        return 0.0 if last is None else total - last

    def _hung(self, job, members, vectors) -> list[LoudFlag]:
        stalled, calling = [], 0
        for i, ((host, rank), v) in enumerate(zip(members, vectors)):
            key = (*job, host, rank)
            rates = [_num(v.get(name)) for name in CALL_RATES if name in v]
            called = any(r > 0 for r in rates)
            if called:
                self.calling[key] = self.calling.get(key, 0) + 1
                calling += 1
            elif self.calling.get(key, 0) >= self.history:
                stalled.append(i)      # kept its count: the hang lasts until calls return
            else:
                self.calling.pop(key, None)
        if not stalled or calling:
            return []
        return [LoudFlag(i, members[i][0], members[i][1], "hung", {"collective_stalled": 1.0}) for i in stalled]


def _num(v) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return 0.0
    return f if math.isfinite(f) else 0.0
