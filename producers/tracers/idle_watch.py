"""Which traced processes just went idle: the moment to read where they are, before the next sampler window.

The py-spy sampler (python_sampler.py) dumps each rank's main-thread stack at the end of its windows
(5 s by default), staggered across ranks, so a hung job's stacks were all in only 4-5 s after the hang
began (measured on the dev scenario hang_rank_short: rank 2's first dump in the hang came 5 windows in),
and the worker can name a hang's culprit only from every rank's stack (streams/model/loud.py). A training
rank is never idle for most of a second; a hung one, and every peer blocked waiting for it, is (its CPU
time stops: 0.00-0.02 cores in every hang window of that run, 0.17 before). So the sampler dumps a
process as it goes idle, as ByteRobust and Mycroft dump stacks on a hang, and otherwise keeps
its cadence. Cost: one read of /proc/<pid>/stat per process and tick while it runs, and up to
DUMPS_PER_SPELL dumps (~10 ms of the agent's CPU each, the traced process not stopped) per idle spell.
More than one: a rank that goes idle at the very end of a stream window is dumped in that window, which
still held calls, and the worker reads stacks only from inside the silence (on the dev hang twin the
single dumps all landed in the step before the first silent one).
"""
from __future__ import annotations

from fleetscope.producers.process_sampler import Vanished, process_cpu_ns

IDLE_CPU_FRAC = 0.05   # below 5% of one core over the span: idle (a training rank used 0.17 here)
# judged over at least 0.75 s, so one blocked moment is not idle; under the agent's 1 s tick, so each tick judges
# (at 1.0 a tick that came a hair early waited for the next: the dev hang's waiting ranks were dumped a window late)
MIN_SPAN_S = 0.75
DUMPS_PER_SPELL = 3    # the first three ticks of an idle spell: each stream window of its start holds one


class IdleWatch:
    """Per process: its CPU time at the start of the current span, and how many idle spans its current idle
    spell has had (none: its last span was busy)."""

    def __init__(self, idle_cpu_frac: float = IDLE_CPU_FRAC, min_span_s: float = MIN_SPAN_S,
                 dumps_per_spell: int = DUMPS_PER_SPELL):
        self.idle_cpu_frac, self.min_span_ns = idle_cpu_frac, int(min_span_s * 1e9)
        self.dumps_per_spell = dumps_per_spell
        self.spans: dict[int, tuple[int, float]] = {}   # pid -> (span start, CPU ns then)
        self.idle: dict[int, int] = {}                # pid -> idle spans so far in its current spell

    def newly_idle(self, pids, now_ns: int, cpu_ns=None) -> list[int]:
        """The pids whose span of at least min_span_s just ended idle, in the first dumps_per_spell spans of
        their idle spell (one ends at a span that was not idle). cpu_ns(pid) -> CPU time so far (default:
        /proc/<pid>/stat)."""
        cpu_ns = cpu_ns or process_cpu_ns
        out = []
        for pid in pids:
            try:
                used = cpu_ns(pid)
            except (OSError, Vanished, ValueError, IndexError):
                self.forget(pid)
                continue
            start = self.spans.get(pid)
            if start is None:
                self.spans[pid] = (now_ns, used)
                continue
            span = now_ns - start[0]
            if span < self.min_span_ns:
                continue
            self.spans[pid] = (now_ns, used)
            if (used - start[1]) / span < self.idle_cpu_frac:
                self.idle[pid] = self.idle.get(pid, 0) + 1
                if self.idle[pid] <= self.dumps_per_spell:
                    out.append(pid)
            else:
                self.idle.pop(pid, None)
        for gone in set(self.spans) - set(pids):
            self.forget(gone)
        return out

    def forget(self, pid: int) -> None:
        self.spans.pop(pid, None)
        self.idle.pop(pid, None)
