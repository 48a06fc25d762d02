"""IdleWatch (producers/tracers/idle_watch.py): which processes just went idle, in the first ticks of each idle
spell. The CPU clock here is a function the test sets, so that spans and CPU use are exact; the real /proc path
is tested with real processes in test_hang_culprit_sampler.py."""
from __future__ import annotations

import os

from fleetscope.producers.process_sampler import process_cpu_ns
from fleetscope.producers.tracers.idle_watch import IdleWatch

SEC = 10**9


def test_a_process_is_reported_as_it_goes_idle_and_again_only_after_it_was_busy():
    used = {1: 0, 2: 0}
    watch = IdleWatch(idle_cpu_frac=0.05, min_span_s=1.0, dumps_per_spell=1)
    seen = []
    for t, busy in enumerate([True, True, False, False, False, True, False]):
        used[1] += SEC // 5 if busy else SEC // 100   # 0.2 cores, then 0.01
        used[2] += SEC // 5                            # always busy
        seen.append(watch.newly_idle([1, 2], t * SEC, used.__getitem__))
    # the first call only starts a span; the spell of t=2..4 is reported at its first span, t=6 is a new one
    assert seen == [[], [], [1], [], [], [], [1]]


def test_shorter_spans_wait_and_a_process_gone_is_forgotten():
    used = {1: 0}
    watch = IdleWatch(min_span_s=1.0, dumps_per_spell=1)
    assert watch.newly_idle([1], 0, used.__getitem__) == []
    assert watch.newly_idle([1], SEC // 2, used.__getitem__) == []    # half a second: not judged yet
    assert watch.newly_idle([1], SEC, used.__getitem__) == [1]
    assert watch.newly_idle([], 2 * SEC, used.__getitem__) == [] and 1 not in watch.spans

    def vanished(pid):
        raise FileNotFoundError(pid)
    assert watch.newly_idle([1], 3 * SEC, vanished) == [] and 1 not in watch.spans


def test_the_cpu_clock_is_this_process_s_own():
    before = process_cpu_ns(os.getpid())
    x = 0
    while process_cpu_ns(os.getpid()) == before:   # spins until the kernel's clock ticks past
        x += 1
    assert process_cpu_ns(os.getpid()) > before


def test_by_default_every_tick_of_the_agent_judges_even_one_that_comes_a_little_early():
    used = {1: 0}
    watch = IdleWatch()
    assert watch.newly_idle([1], 0, used.__getitem__) == []
    assert watch.newly_idle([1], SEC - SEC // 100, used.__getitem__) == [1]   # 0.99 s after: judged, idle


def test_by_default_the_first_three_ticks_of_a_spell_are_reported():
    """A spell that starts at a stream window's very end is dumped in the next windows too (idle_watch.py)."""
    used = {1: 0}
    watch = IdleWatch()
    seen = [watch.newly_idle([1], t * SEC, used.__getitem__) for t in range(6)]
    assert seen == [[], [1], [1], [1], [], []]
