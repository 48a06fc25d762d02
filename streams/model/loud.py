"""Loud failures, alerted in the window they appear, without waiting for a model to learn them.

Per job step (all ranks of one window, each vector joined with its node and
GPU, see streams/rank_context.py):

- ``xid``: the rank's GPU raised an Xid (``gpu_xid_count`` >= 1);
- ``ecc``: its GPU reported a double-bit ECC event, or its count of
  uncorrected ECC errors or of rows pending/failing remap grew since the
  previous window (``gpu_ecc_new_errors``; the counts are cumulative, so a
  value that merely stays non-zero is not new);
- ``crashed``: a process of the rank crashed in this window: the kernel tracer saw it end by a
  signal other than a stop request, or exit non-zero (``process_exit_abnormal``, see
  streams/exit_features.py). A launcher tears the job down when one rank dies (torchrun sends the
  others SIGTERM, which is a stop, not a crash), but peers that lose their collective partner may
  also die on their own first (an exception: exit 1). So the job's first crashed step names its
  culprits: the ranks a signal killed, or, when none was, every rank that crashed; the other ranks
  that crash in that step or in steps up to ``crash_collateral_s`` after it are ``waiting``
  (they went down because of it). Counted in late steps too: an exit is an event, like an Xid;
- ``vanished``: a rank of the job sent nothing while its peers went on
  reporting for ``vanish_windows`` steps without it (a crashed or killed
  rank); it gets a row of its own with ``rank_vanished`` = 1, in the window
  it died in (the first one missing: that window stays open for late rows, so
  the step goes on without it once ``step_hold_s`` has passed), alerted once
  the peers' ``vanish_windows``-th step without it is released. A job that
  ends normally stops its ranks a moment apart: the last ones report a window
  or two more, then stop too, so a rank gone while the job itself stops
  within that grace is not an alarm (measured on the 3-rank gloo CI job:
  ranks 0 and 1 flagged vanished in its last windows before the grace). A
  step older than the job's newest (such a window, closed later by
  ``idle_close_s``) changes no membership;
- ``hung``: every rank that had been completing collectives (NCCL calls, or
  gloo collectives issued or waits) for ``history`` windows completed none for ``hang_windows``
  steps in a row, while every rank of the job still reports: the tracers
  report a call when it returns, so a call stuck in flight reads as silence.
  A job that ends normally goes silent in its collectives for the window or
  two its ranks take to exit, then its ranks stop reporting: shorter than
  ``hang_windows``, or with ranks gone, it is not a hang (a rank gone is
  ``vanished``'s). A gloo rank with neither ``torch_collectives_per_s`` nor
  ``torch_comm_waits_per_s`` has no collective probes attached this window
  (the torch tracer sends a measured 0 while they are; the governor
  duty-cycles the waits and may shed the marks): unknown, not silent. The
  NCCL tracer sends rows only for calls, so its absence stays silence. The
  call rates cannot tell the stuck rank from the ones it blocks; their
  sampled Python stacks can (as ByteRobust and Mycroft do with stack dumps):
  each rank's latest ``python_top_frame_id`` seen since the silence began
  (streams/stack_signature.py: the function its main thread was in, idle or
  not, at the end of a sampler window). When every rank of the step
  is stalled and has one, and a strict majority shares one signature while
  the others differ, the others are ``culprit`` and the majority ``waiting``.
  Such a named hang is alerted after ``named_hang_windows`` silent steps
  (default 1: the goal is a hang within one window); a silence the stacks
  cannot explain waits for ``hang_windows``. Otherwise (no sampler, a rank
  without a signature or not known to be stalled, all alike, no majority)
  every rank gets role ``job``: never a guess. The step in which a flagged
  hang's calls return is flagged too, with the hang's roles: part of it was
  hung.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from collections import Counter
from typing import Mapping, Sequence

from fleetscope.streams.exit_features import ABNORMAL, SIGNAL
from fleetscope.streams.model.job_rate import RATE_FEATURES
from fleetscope.streams.model.roles import CULPRIT, JOB, WAITING
from fleetscope.streams.stack_signature import FEATURE as FRAME_FEATURE

CALL_RATES = RATE_FEATURES   # the job's collective rate features (job_rate.py): NCCL's, then gloo's
GLOO_RATES = tuple(name for name in CALL_RATES if name.startswith("torch_"))
ECC_COUNTS = ("gpu_ecc_uncorrected", "gpu_row_remap_pending")
KIND_FEATURE = {"xid": "gpu_xid_count", "ecc": "gpu_ecc_new_errors", "vanished": "rank_vanished",
                "hung": "collective_stalled", "crashed": "rank_crashed"}


@dataclass
class LoudFlag:
    index: int | None          # the step row it concerns; None for a vanished rank (no row)
    host: str
    rank: int
    kind: str                  # xid | ecc | crashed | vanished | hung
    features: dict[str, float] = field(default_factory=dict)
    start_ns: int | None = None  # a vanished rank: the window it went silent in (the first one missing)
    role: str = ""             # set by the check itself (hung: culprit/waiting/job, crashed: culprit/waiting);
    #                            "" lets the scorer decide


class LoudFailures:
    def __init__(self, history: int = 3, vanish_windows: int = 4, hang_windows: int = 4,
                 named_hang_windows: int = 1, crash_collateral_s: float = 10.0):
        self.history = history
        self.crash_collateral_s = crash_collateral_s  # after a job's first crash, how long further crashes wait on it
        self.first_crash: dict[tuple[str, str], int] = {}           # job -> start of its first crashed step
        # job -> {(host, rank): its crashed step}: not ``vanished`` too, until it reports again after that step
        self.crashed_at: dict[tuple[str, str], dict[tuple[str, int], int]] = {}
        self.vanish_windows = vanish_windows   # peers' steps without a rank before it is vanished
        self.hang_windows = hang_windows       # silent steps in a row, every rank reporting, before a hang
        # ...before a hang whose stacks name its culprits (a strict minority in another function): sooner, since
        # a whole job silent while most of it waits in one place and a few ranks elsewhere is what a hang is
        self.named_hang_windows = min(named_hang_windows, hang_windows)
        self.members: dict[tuple[str, str], set[tuple[str, int]]] = {}
        # (job) -> {(host, rank): [first missing step start, peers' steps without it]}; -1 once flagged
        self.missing: dict[tuple[str, str], dict[tuple[str, int], list[int]]] = {}
        self.silent: dict[tuple[str, str], list[int]] = {}         # the job's silent steps in a row
        self.frames: dict[tuple[str, str], dict[tuple[str, int], float]] = {}  # latest top frame in the silence
        self.hang_roles: dict[tuple[str, str], dict[tuple[str, int], str]] = {}  # the flagged hang's roles
        self.gloo: set[tuple[str, str, str, int]] = set()          # ranks whose collectives the torch tracer reports
        self.newest: dict[tuple[str, str], int] = {}               # the job's newest step start
        self.calling: dict[tuple[str, str, str, int], int] = {}   # windows in a row with completed collectives
        self.ecc_seen: dict[tuple[str, int], float] = {}            # (host, rank) -> its GPU's last cumulative count
        self.counts = {"xid": 0, "ecc": 0, "crashed": 0, "vanished": 0, "hung": 0}

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
        flags += self._crashed(job, start_ns, members, vectors)
        if late:   # a late or replayed step: its hardware events count, its membership and silence do not
            return self._count(flags)
        self.newest[job] = start_ns
        present = set(members)
        flags += self._vanished(job, start_ns, present)
        flags += self._hung(job, members, vectors)
        return self._count(flags)

    def _crashed(self, job, start_ns: int, members, vectors) -> list[LoudFlag]:
        """Ranks with a crashed process in this step: the job's first crash names its culprits, the crashes
        that follow it within ``crash_collateral_s`` wait on it."""
        crashed = [i for i, v in enumerate(vectors) if _num(v.get(ABNORMAL)) >= 1]
        if not crashed:
            return []
        first = self.first_crash.get(job)
        if first is None or not first <= start_ns <= first + int(self.crash_collateral_s * 1e9):
            self.first_crash[job] = first = start_ns   # a new crash: this step names its culprits
        gone = self.crashed_at.setdefault(job, {})
        for i in crashed:
            gone[members[i]] = start_ns
        culprits = set()
        if start_ns == first:
            culprits = {i for i in crashed if _num(vectors[i].get(SIGNAL)) > 0} or set(crashed)
        return [LoudFlag(i, members[i][0], members[i][1], "crashed",
                         {"rank_crashed": 1.0, SIGNAL: _num(vectors[i].get(SIGNAL))},
                         role=CULPRIT if i in culprits else WAITING) for i in crashed]

    def _vanished(self, job, start_ns: int, present: set) -> list[LoudFlag]:
        """Ranks that its peers have gone on without for ``vanish_windows`` steps; each flagged once."""
        known = self.members.setdefault(job, set())
        known |= present
        missing = self.missing.setdefault(job, {})
        crashed = self.crashed_at.setdefault(job, {})
        for member in present:
            missing.pop(member, None)     # back (a late or slow rank): not gone
            if crashed.get(member, start_ns) < start_ns:
                del crashed[member]       # restarted after its crash: it can vanish again
        flags = []
        for member in sorted(known - present - set(crashed)):   # a crashed rank was alerted as such
            seen = missing.setdefault(member, [start_ns, 0])
            if seen[1] < 0:
                continue                  # flagged already
            seen[1] += 1
            if seen[1] >= self.vanish_windows:
                seen[1] = -1
                flags.append(LoudFlag(None, member[0], member[1], "vanished", {"rank_vanished": 1.0}, seen[0]))
        return flags

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
            if key in self.gloo and not any(name in v for name in GLOO_RATES) and "nccl_calls_per_s" not in v:
                continue      # its gloo probes are detached this window: unknown, neither calling nor silent
            rates = [_num(v.get(name)) for name in CALL_RATES if name in v]
            if any(name in v for name in GLOO_RATES):
                self.gloo.add(key)
            called = any(r > 0 for r in rates)
            if called:
                self.calling[key] = self.calling.get(key, 0) + 1
                calling += 1
            elif self.calling.get(key, 0) >= self.history:
                stalled.append(i)      # kept its count: the hang lasts until calls return
            else:
                self.calling.pop(key, None)
        silent = self.silent.setdefault(job, [0])
        # a rank stopped reporting, or crashed and has not come back: the job's silence is theirs to explain
        leaving = any(n >= 0 for _, n in self.missing.get(job, {}).values()) or bool(self.crashed_at.get(job))
        frames = self.frames.setdefault(job, {})
        if not stalled or calling or leaving:
            silent[0] = 0   # calls return, or a rank stopped reporting (the job ending, or vanished's to judge)
            frames.clear()  # stacks from before a silence say nothing about it
            return self._hang_ended(job, members, calling > 0 and not leaving)
        silent[0] += 1
        for member, v in zip(members, vectors):
            if FRAME_FEATURE in v and math.isfinite(_num(v[FRAME_FEATURE])):
                frames[member] = float(v[FRAME_FEATURE])
        if silent[0] < self.named_hang_windows:
            return []
        roles = self._hang_roles([frames.get(m) for m in members]) if len(stalled) == len(members) else {}
        if silent[0] < self.hang_windows and not roles:
            return []   # all alike (a phase every rank is in) or no stacks: only a longer silence is a hang
        self.hang_roles[job] = {members[i]: roles.get(i, JOB) for i in stalled}
        return [LoudFlag(i, members[i][0], members[i][1], "hung", {"collective_stalled": 1.0},
                         role=roles.get(i, JOB)) for i in stalled]

    def _hang_ended(self, job, members, resumed: bool) -> list[LoudFlag]:
        """The step a flagged hang's calls return in was hung for part of it: its ranks keep the hang's roles there
        (the job's slower rate in that step is the hang's, not a new change that every rank shares: on the dev
        scenario hang_rank_short the job's rate flagged each rank role job in it, the waiting ones included)."""
        roles = self.hang_roles.pop(job, {})
        if not resumed:
            return []
        return [LoudFlag(i, m[0], m[1], "hung", {"collective_stalled": 1.0}, role=roles[m])
                for i, m in enumerate(members) if m in roles]

    @staticmethod
    def _hang_roles(signatures: Sequence[float | None]) -> dict[int, str]:
        """Ranks in a strict majority of equal stack signatures wait; the others are the culprits. {} (every
        rank role job) when a rank has no signature, all are alike, or no signature holds a strict majority."""
        if not signatures or any(s is None for s in signatures):
            return {}
        (common, n), = Counter(signatures).most_common(1)
        if n == len(signatures) or 2 * n <= len(signatures):
            return {}
        return {i: WAITING if s == common else CULPRIT for i, s in enumerate(signatures)}


def _num(v) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return 0.0
    return f if math.isfinite(f) else 0.0
