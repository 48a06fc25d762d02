"""Who arrives last at each collective, from the communicators' sequence numbers.

In a synchronous job every rank enters the same collectives in the same order.
Two tracers mark when a process entered each collective, numbered the same
way on every rank of its communicator (device "<communicator>#<n>"):
- NCCL (`nccl.coll_entry_ns`, producers/tracers/nccl.py): each
  communicator's collectives counted from its init; the communicator is named
  by its unique id, the same on every rank;
- gloo (`torch.coll_entry_ns`, producers/tracers/gloo_marks.py): the process
  group's own collective counter (its tags), at the moment the collective is
  issued; the group is "gloo<g>", numbered per process in order of first use.
So for the n-th collective of a communicator the ranks' entry times can be
compared: the rank that enters last is the one the others wait for. Collective durations cannot tell that (the peers wait inside the
call, so synchronisation evens them out, and NCCL's host-side calls only
enqueue work); the order of arrival can. Mycroft, Aegis and PyTorch's flight
recorder localize stragglers the same way.

Per job step, over the collectives whose entry every rank of the communicator
has reported (a collective that some ranks report only in the next window's
sample waits one step for them, then is compared with whoever reported it),
each rank's window gets:
- ``arrival_lag_s``: how long after the first rank it entered, on average;
- ``arrival_wait_frac``: how long before the last rank it entered (its
  wait for the last arriver), on average, times its collectives per second:
  the share of the window it spent waiting for a later peer. The last arriver
  has about 0; in `model/roles.py` this is the wait share that decides who is
  a culprit and who is waiting, ahead of the time spent inside NCCL calls or
  gloo's waits. The rate of collectives is NCCL's sequenced calls plus gloo's
  issued collectives (`torch.coll_issued`).

Both are computed across ranks, so they are evidence and role inputs, never
model inputs (feature_catalogue.STEP_FEATURES). Ranks on different hosts are
compared through their clocks: the resolution is the hosts' clock skew (NTP:
about a millisecond), enough for stragglers that cost tens of milliseconds a
step. Entry is the host reaching the call: a rank slowed on its GPU alone,
whose host runs ahead of it, arrives on time here.
"""
from __future__ import annotations

from fleetscope.schema import NODE_TENANT
from fleetscope.streams.trace_features import _sum

MARKS = (("nccl", "nccl.coll_entry_ns"), ("torch", "torch.coll_entry_ns"))  # (source, metric)
# the calls the NCCL tracer counts in a communicator's sequence (bpf/nccl.bpf.c: enter_collective)
SEQUENCED = ("AllReduce", "ReduceScatter", "AllGather", "Broadcast", "Reduce")
ARRIVAL_FEATURES = ("arrival_lag_s", "arrival_wait_frac")
CARRY_STEPS = 1      # a collective not yet reported by every rank waits this many steps for the rest
IDLE_NS = 120 * 10**9  # a job with no step for this long (event time) is forgotten

MarkKey = tuple[str, int]        # (communicator uid, sequence number)
Member = tuple[str, int]         # (host, rank)


class ArrivalOrder:
    """The open collectives of each job, across steps (a job's steps arrive in window order)."""

    def __init__(self) -> None:
        self._open: dict[tuple[str, str], dict[MarkKey, dict[Member, float]]] = {}
        self._age: dict[tuple[str, str], dict[MarkKey, int]] = {}
        self._width: dict[tuple[str, str, str], int] = {}   # (tenant, job, uid) -> most ranks seen on it
        self._last_start: dict[tuple[str, str], int] = {}
        self.compared = 0   # collectives compared across two or more ranks
        self.single = 0     # collectives only one rank reported: nothing to compare

    def add(self, windows, vectors) -> None:
        """Add the arrival features to the vectors of the job steps among `windows` (in place)."""
        steps: dict[tuple[str, str, int], list[int]] = {}
        for i, w in enumerate(windows):
            if w.key[0] != NODE_TENANT:
                steps.setdefault((w.key[0], w.key[1], w.start_ns), []).append(i)
        for tenant, job, start in sorted(steps, key=lambda k: k[2]):
            idx = steps[(tenant, job, start)]
            self._step((tenant, job), [windows[i] for i in idx], [vectors[i] for i in idx])
            self._last_start[(tenant, job)] = max(start, self._last_start.get((tenant, job), start))
        if steps:
            self._forget_idle(max(k[2] for k in steps))

    def _step(self, job: tuple[str, str], windows, vectors) -> None:
        marks = self._open.setdefault(job, {})
        ages = self._age.setdefault(job, {})
        for w in windows:
            member = (w.key[2], w.key[3])
            for source, metric in MARKS:
                for agg in w.devices(source, metric):
                    uid, _, seq = agg.device.partition("#")
                    if seq.isdigit() and agg.gauge_n:
                        marks.setdefault((uid, int(seq)), {})[member] = agg.gauge_last
        for (uid, _), by_member in marks.items():
            width = (*job, uid)
            self._width[width] = max(self._width.get(width, 0), len(by_member))
        done = []
        for key in list(marks):
            by_member = marks[key]
            if len(by_member) >= self._width[(*job, key[0])] or ages.get(key, 0) >= CARRY_STEPS:
                del marks[key]
                ages.pop(key, None)
                if len(by_member) >= 2:
                    done.append(by_member)
                else:
                    self.single += 1
            else:
                ages[key] = ages.get(key, 0) + 1
        self.compared += len(done)
        lags: dict[Member, list[float]] = {}
        waits: dict[Member, list[float]] = {}
        for by_member in done:
            first, last = min(by_member.values()), max(by_member.values())
            for member, ts in by_member.items():
                lags.setdefault(member, []).append(ts - first)
                waits.setdefault(member, []).append(last - ts)
        for w, v in zip(windows, vectors):
            member = (w.key[2], w.key[3])
            if member not in lags:
                continue
            v["arrival_lag_s"] = sum(lags[member]) / len(lags[member]) / 1e9
            counts = [c for c in (_sum(w, "nccl", "nccl.calls", SEQUENCED), _sum(w, "torch", "torch.coll_issued"))
                      if c is not None]
            if counts:
                per_s = sum(counts) / ((w.end_ns - w.start_ns) / 1e9)
                v["arrival_wait_frac"] = sum(waits[member]) / len(waits[member]) / 1e9 * per_s

    def _forget_idle(self, newest_start: int) -> None:
        for job in [j for j, s in self._last_start.items() if newest_start - s > IDLE_NS]:
            self._open.pop(job, None)
            self._age.pop(job, None)
            del self._last_start[job]
            for width in [k for k in self._width if k[:2] == job]:
                del self._width[width]

    def open_collectives(self) -> int:
        return sum(len(m) for m in self._open.values())
