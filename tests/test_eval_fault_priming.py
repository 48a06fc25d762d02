"""The runner primes a fault's injectors before it starts them (Run.fault_prime), all of them at once.

The run's stack and workload are not started here: _sleep_until and _injectors are replaced so that only
the schedule is exercised. What priming is for is tested on real processes in tests/test_eval_faults.py
(a CPU quota on the usage basis)."""
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
