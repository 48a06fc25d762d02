"""The runner primes a fault's injectors before it starts them (Run.fault_prime), all of them at once.

The run's stack and workload are not started here: _sleep_until and _injectors are replaced so that only
the schedule is exercised. What priming is for is tested on real processes in tests/test_eval_faults.py
(a CPU quota on the usage basis). Last, which relay a link fault degrades."""
from __future__ import annotations

from fleetscope.eval.runner import PRIME_LEAD_S, Run, RunOptions
from fleetscope.eval.scenario import load_scenario

SCENARIO = """
name: priming
description: a quota on every rank, twice
workload: ddp_cpu
ranks: 3
duration_s: 40
window_s: 1
faults:
  - kind: cpu_quota
    target: all
    start_s: 10
    duration_s: 5
    every_s: 15
    times: 2
    strength: 0.3
    params: {basis: usage}
    expect: {kb_entry: job_wide_slowdown, scope: job}
"""


class Recorder:
    def __init__(self, rank, calls):
        self.rank, self.calls = rank, calls

    def prime(self):
        self.calls.append(("prime", self.rank))

    def start(self):
        self.calls.append(("start", self.rank))

    def stop(self):
        self.calls.append(("stop", self.rank))

    def describe(self):
        return {"rank": self.rank}


def test_every_ranks_injector_is_primed_before_any_starts_ahead_of_each_burst(tmp_path):
    path = tmp_path / "priming.yaml"
    path.write_text(SCENARIO)
    run = Run(load_scenario(path), RunOptions(work_dir=tmp_path, plot=False, progress=lambda _: None))
    calls, times = [], []
    run._sleep_until = lambda wall_s, what, every_s=10.0: times.append((round(wall_s - 1000.0, 3), what))
    run._injectors = lambda f: [Recorder(r, calls) for r in range(3)]
    run.inject_and_run(1000.0)
    burst = [("prime", r) for r in range(3)] + [("start", r) for r in range(3)] + [("stop", r) for r in range(3)]
    assert calls == burst + burst
    primes = [t for t, what in times if what.endswith("prime")]
    assert primes == [10 - PRIME_LEAD_S, 25 - PRIME_LEAD_S]


LINK = """
name: link
description: the link into rank 2 slows
workload: gpu_standin
ranks: 3
duration_s: 40
window_s: 1
requires: [gpu_standin]
fault:
  kind: link_delay
  rank: 2
  start_s: 10
  duration_s: 5
  strength: 1.0
  params: {delay_ms: 8, bandwidth_mbps: 400}
expect: {kb_entry: slow_degraded_link, ranks: [2]}
"""


def test_a_link_fault_slows_the_relay_in_front_of_its_own_rank(tmp_path):
    """The GPU stand-in puts a relay in front of every rank (`relays`) and exposes rank 1's as `relay`; a link
    fault on rank 2 degrades rank 2's, not rank 1's. Real (unstarted) DelayRelays; the workload is not run."""
    from types import SimpleNamespace

    from fleetscope.eval.relay import DelayRelay
    path = tmp_path / "link.yaml"
    path.write_text(LINK)
    run = Run(load_scenario(path), RunOptions(work_dir=tmp_path, plot=False, progress=lambda _: None))
    relays = [DelayRelay(("127.0.0.1", 1)) for _ in range(3)]
    run.workload = SimpleNamespace(relay=relays[1], relays=relays)
    run.pids = {r: 1000 + r for r in range(3)}
    (injector,) = run._injectors(run.s.faults[0])
    injector.start()
    assert [r.delay_s for r in relays] == [0.0, 0.0, 0.008]
    assert relays[2].bandwidth_bps == 400e6
    injector.stop()
    assert [r.delay_s for r in relays] == [0.0, 0.0, 0.0]
