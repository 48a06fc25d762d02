"""The overhead governor: keeps probe hits inside a budget of the traced processes' time.

Every uprobe hit stops the traced thread for a few microseconds (about 5–6 µs
on our VMs, measured by `calibrate.py`), whatever the BPF program does. A
family that fires often — kernel launches, Python functions, torch ops —
would slow the job it watches by whole multiples. So each period the governor:

1. measures the budget's base over the last period: the traced processes' CPU
   time, or their wall time while they mostly wait (see below);
2. charges the always-on families (collectives, memcpy, malloc/free, sync,
   GC) their hits × the per-hit cost. They stay on while they fit the budget
   together. When they alone exceed it for `shed_after` periods in a row
   (a sustained overrun, not a burst such as a process's start-up), the
   most expensive of them are shed (detached) until the rest fit: each family's cost is kept as a share of
   the budget's base, measured while it was attached, and families are
   shed from the largest share down. A shed family is retried (attached for
   one period, re-measured) every `shed_periods` periods, so a burst does
   not switch it off for good; meanwhile it comes back as soon as the
   others' shares leave room for its own. The decision lists shed families
   (`shed`), the manager reports them in the agent's stats;
3. gives what is left of `budget × CPU time` to the expensive families in
   equal shares, as tokens in a bucket per family; each period the bucket is
   charged the hits the family actually took × the per-hit cost. A family
   whose bucket is empty stays detached for the period; otherwise its duty
   cycle follows its measured cost (cut at once, grown at most twofold).

Charging measured hits, not a model of them, keeps the long-run cost inside
the budget even though attaching and detaching a uprobe takes tens of
milliseconds on our VMs (so the real on-time of a short slice is not what was
planned). A family never goes dark for long: the bucket refills every period.
The duty cycle actually applied is reported by each tracer as `sample_frac`,
so downstream rates scale honestly.

The budget is checked against the traced processes taken together; the
tracers count hits per family, not per process.

What the always-on families' budget is a share of (`base_s`): the traced
processes' CPU time, or their wall time when that is larger and the host has
the idle CPU to absorb the probes' work. A hit stalls one thread for its cost, so it delays a
process by at most that cost, whether the process was running or waiting
(on a GPU, on its peers): a process that mostly waits is slowed by hits ×
cost / wall time, not / its CPU time. Judged by CPU time alone, a job whose
host threads wait on the GPU looked many times over budget (the GPU
stand-in's ranks use 4% of a core each: their always-on CUDA memory probes
measured 1.7x the budget), and a rank that stalled on a fault used even less
CPU, so the family that saw the fault was shed at its onset (the dev
scenario memcpy_stall lost its copy timings 12 s into the fault). When the
host's CPUs are all busy, a probe's work takes CPU time from the job itself,
and the base stays the CPU time (see `budget_base_s`).

The expensive families share what is left of the budget of the CPU time
alone, as before: some cost far more than their hits (Python's USDT function
probes slowed a rank threefold; gloo's waits, on the critical path of each
chunk, about 10% of the step rate while attached), so the larger base would
buy them real slowdown. Judged on the wall-time base, the dev scenario
healthy_rank_differs (3 gloo ranks using 0.8 of the 2 cores) ran gloo's waits
at 14% duty instead of 8%, over budget, and flagged its busy rank 20 times.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from fleetscope.producers.process_sampler import Vanished, process_cpu_ns

EXPENSIVE, ALWAYS = "expensive", "always"


@dataclass
class FamilyState:
    kind: str
    duty: float = 1.0
    active_duty: float = 1.0  # the duty of the last period it was attached
    last_hits: int = 0
    bucket_s: float = 0.0  # probe-cost seconds it may still spend
    on_s: float = 0.0  # attached time in the period being measured (reported, not used for control)
    cost_frac: float = 0.0  # always-on: its cost per second of the budget's base, last measured while attached
    shed_for: int = 0  # always-on: periods it has been shed (0: attached)
    retrying: bool = False  # always-on: attached again after a shed, its overrun already proven


def budget_base_s(cpu_s: float, active_processes: int, period_s: float, host_idle_s: float) -> float:
    """The time the budget is a share of: the traced processes' CPU time, or their wall time (one timeline
    per process that ran in the period), as far as the host's idle CPU time can absorb the difference."""
    wall_s = max(active_processes, 0) * max(period_s, 0.0)
    return max(cpu_s, min(wall_s, cpu_s + max(host_idle_s, 0.0)))


@dataclass
class GovernorDecision:
    base_s: float  # the budget's base (budget_base_s): CPU time, or wall time for processes that mostly wait
    budget_s: float
    always_cost_s: float
    duties: dict = field(default_factory=dict)  # (tracer, family) -> duty in {0} ∪ [min_duty, 1]
    spent_s: float = 0.0  # the probe cost the period just ended actually took
    shed: tuple = ()  # always-on (tracer, family) keys detached because they alone exceeded the budget


class OverheadGovernor:
    def __init__(self, budget_frac: float = 0.01, hit_cost_ns: float = 6000.0, min_duty: float = 0.005,
                 first_duty: float = 0.02, bucket_periods: float = 2.0, shed_periods: int = 10,
                 shed_after: int = 2):
        if not 0 < budget_frac <= 0.5:
            raise ValueError("budget_frac must lie in (0, 0.5]")
        self.budget_frac = budget_frac
        self.hit_cost_s = hit_cost_ns / 1e9
        self.min_duty = min_duty
        self.first_duty = first_duty  # an unmeasured expensive family starts here, not at 1
        self.bucket_periods = bucket_periods  # savings cap, in periods' shares
        self.shed_periods = shed_periods  # a shed always-on family is retried after this many periods
        self.shed_after = shed_after  # periods in a row the always-on families exceed the budget before a shed
        self.over_periods = 0
        self.families: dict[tuple[str, str], FamilyState] = {}

    def register(self, tracer: str, family: str, kind: str) -> float:
        """Add a family; returns its starting duty."""
        duty = 1.0 if kind == ALWAYS else self.first_duty
        self.families[(tracer, family)] = FamilyState(kind, duty=duty, active_duty=duty)
        return duty

    def unregister(self, tracer: str) -> None:
        for key in [k for k in self.families if k[0] == tracer]:
            del self.families[key]

    def record_on_time(self, key: tuple[str, str], seconds: float) -> None:
        self.families[key].on_s += seconds

    def update(self, hits: dict[tuple[str, str], int], base_s: float, period_s: float,
               cpu_s: float | None = None) -> GovernorDecision:
        """New duties from the period just ended: cumulative hits per family, the budget's base in seconds
        (budget_base_s: the targets' CPU time, or their wall time while they mostly wait) and the targets' CPU
        time (default: the base). The always-on families are judged against the base; the expensive ones
        share what is left of the budget of the CPU time alone."""
        costs: dict[tuple[str, str], float] = {}
        for key, state in self.families.items():
            total = int(hits.get(key, state.last_hits))
            costs[key] = max(total - state.last_hits, 0) * self.hit_cost_s
            state.last_hits = total
            state.on_s = 0.0
        always_cost = sum(c for k, c in costs.items() if self.families[k].kind == ALWAYS)
        budget = self.budget_frac * max(base_s, 0.0)
        decision = GovernorDecision(base_s=base_s, budget_s=budget, always_cost_s=always_cost,
                                    spent_s=sum(costs.values()))
        kept_cost = self._shed_always(costs, base_s, decision)
        expensive = [(k, st) for k, st in self.families.items() if st.kind == EXPENSIVE]
        cpu_budget = self.budget_frac * max(base_s if cpu_s is None else cpu_s, 0.0)
        share = max(cpu_budget - kept_cost, 0.0) / len(expensive) if expensive else 0.0
        for key, state in expensive:
            cost = costs[key]
            state.bucket_s = min(state.bucket_s + share - cost, self.bucket_periods * share)
            if state.duty > 0:  # it was attached: steer by what it cost
                factor = 2.0 if cost <= 0 else min(2.0, max(0.1, share / cost))
                state.active_duty = min(1.0, max(self.min_duty, state.duty * factor))
            state.duty = state.active_duty if state.bucket_s >= 0 else 0.0
            decision.duties[key] = state.duty
        return decision

    def _shed_always(self, costs: dict, base_s: float, decision: GovernorDecision) -> float:
        """Duties of the always-on families (1, or 0 when shed); returns the cost the attached ones are
        expected to take of the coming period (their last measured shares of this period's base)."""
        always = {k: st for k, st in self.families.items() if st.kind == ALWAYS}
        measured = [k for k, st in always.items() if st.shed_for == 0]
        for key in measured:
            if base_s > 0:  # attached the whole period: a fresh measurement
                always[key].cost_frac = costs[key] / base_s
        if base_s > 0:
            over = sum(costs[k] for k in measured) > self.budget_frac * base_s
            self.over_periods = self.over_periods + 1 if over else 0
        sustained = self.over_periods >= self.shed_after
        retried = {k for k, st in always.items() if st.shed_for >= self.shed_periods}  # attached to re-measure
        kept = {k for k, st in always.items() if st.shed_for == 0}
        for key in sorted((k for k in always if k not in kept | retried), key=lambda k: always[k].cost_frac):
            if sum(always[k].cost_frac for k in kept) + always[key].cost_frac <= self.budget_frac:
                kept.add(key)  # the cheapest shed ones come back first, when the kept ones leave room
        for key in sorted(kept, key=lambda k: -always[k].cost_frac):  # the most expensive go first
            if sum(always[k].cost_frac for k in kept) <= self.budget_frac:
                break
            if sustained or always[key].retrying:
                kept.discard(key)
        for key in kept:
            always[key].retrying = False   # measured a whole period and kept
        for key in retried:
            always[key].retrying = True
        kept |= retried
        for key, st in always.items():
            st.shed_for = 0 if key in kept else st.shed_for + 1
            st.duty = 1.0 if key in kept else 0.0
            decision.duties[key] = st.duty
        decision.shed = tuple(sorted(k for k in always if k not in kept))
        return sum(always[k].cost_frac for k in kept) * max(base_s, 0.0)


def process_cpu_seconds(pids) -> float:
    """Total user+system CPU seconds of the processes (all their threads); gone ones count 0."""
    total_ns = 0.0
    for pid in pids:
        try:
            total_ns += process_cpu_ns(pid)
        except (OSError, Vanished):
            continue
    return total_ns / 1e9


_SECONDS_PER_TICK = 1.0 / os.sysconf("SC_CLK_TCK")


def host_idle_seconds(path: str = "/proc/stat") -> float | None:
    """The host's idle CPU time so far (idle + iowait of all CPUs, /proc/stat's first line), in seconds;
    None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            fields = f.readline().split()
        return (int(fields[4]) + int(fields[5])) * _SECONDS_PER_TICK
    except (OSError, ValueError, IndexError):
        return None
