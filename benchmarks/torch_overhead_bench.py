"""Overhead of the Python and torch tracers on a real PyTorch CPU training loop, in one run.

The loop (tests/workloads/torch_train.py, Debian's python3 with the venv's
torch on PYTHONPATH) prints its steps/s every second. This process is the
agent: it attaches PythonTracer and TorchTracer and samples them every
second. A calibration (one untraced, one all-on block) sizes the duty
fraction; then rounds of untraced / all probes always on / duty-cycled
blocks run interleaved, and each setup's median steps/s is compared.
Duty cycling is governor-like: the expensive families (python "functions",
torch "ops") are attached for a fraction of each 1 s period sized so that
the measured cost of their hits stays within the budget (1% of the loop's
CPU time); "gc" stays on. The cost per hit comes from the all-on phase:
(time per step on - time per step off) / hits per step.

Writes benchmarks/results/torch_overhead.json. Run as root:
  .venv/bin/python benchmarks/torch_overhead_bench.py [--phase-s 5 --rounds 4]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from producers.tracers.python_vm import PythonTracer  # noqa: E402
from producers.tracers.torch_ops import TorchTracer  # noqa: E402

BUDGET = 0.01
EXPENSIVE = (("python", "functions"), ("torch", "ops"))


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


class Loop:
    """The training loop; collects its per-second steps/s under the current phase label."""

    def __init__(self, go: str):
        env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
        self.proc = subprocess.Popen(["/usr/bin/python3", str(ROOT / "tests/workloads/torch_train.py"), go, "0"],
                                     env=env, stdout=subprocess.PIPE, text=True)
        self.phase, self.rates = "warmup", {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.rates.setdefault(self.phase, []).append(float(line))

    def enter(self, phase: str):
        self.phase = "switch"  # the second that straddles the change is not counted
        time.sleep(1.0)
        self.phase = phase


def run_phase(loop, tracers, name, seconds, duty=None):
    loop.enter(name)
    cpu0, t0 = os.times(), time.monotonic()
    end = t0 + seconds
    while time.monotonic() < end:
        if duty is not None:  # on for `duty` of each second, then off
            for t, fam in tracers_families(tracers):
                t.set_family_enabled(fam, True)
            time.sleep(max(duty, 0.0))
            for t, fam in tracers_families(tracers):
                t.set_family_enabled(fam, False)
            time.sleep(max(1.0 - duty, 0.0))
        else:
            time.sleep(1.0)
        for t in tracers.values():
            t.sample()
    cpu1, t1 = os.times(), time.monotonic()
    return 100 * ((cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)) / (t1 - t0)


def set_all(tracers, on):
    for t in tracers.values():
        for fam in t.families():
            t.set_family_enabled(fam, on)


def total_hits(tracers):
    return sum(sum(t.hits().values()) for t in tracers.values())


def tracers_families(tracers):
    return [(tracers[src], fam) for src, fam in EXPENSIVE]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase-s", type=float, default=5)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/torch_overhead.json"))
    args = ap.parse_args()
    go = tempfile.mktemp(prefix="fleetscope-bench-go-")
    loop = Loop(go)
    while not os.path.exists(go + ".ready"):
        time.sleep(0.05)
    open(go, "w").close()
    tracers = {"python": PythonTracer("bench"), "torch": TorchTracer("bench")}
    try:
        for t in tracers.values():
            assert t.add_pid(loop.proc.pid), t.unavailable
        set_all(tracers, False)
        # Calibration: one untraced and one all-on block give the cost per hit and the duty fraction.
        run_phase(loop, tracers, "calib_off", args.phase_s)
        set_all(tracers, True)
        hits0 = total_hits(tracers)
        run_phase(loop, tracers, "calib_on", args.phase_s)
        hits_on = total_hits(tracers) - hits0
        set_all(tracers, False)
        off, on = statistics.median(loop.rates["calib_off"]), statistics.median(loop.rates["calib_on"])
        steps_on = sum(loop.rates["calib_on"])
        cost_per_hit = max(1 / on - 1 / off, 0) / (hits_on / steps_on) if hits_on else 0
        duty = min(1.0, BUDGET / max(1 - on / off, 1e-6))  # keeps hits x cost within BUDGET
        # Measurement: the three setups interleaved, so drift and neighbours' load hit all alike.
        cpu = {"all_on": [], "duty_cycled": []}
        for _ in range(args.rounds):
            run_phase(loop, tracers, "untraced", args.phase_s)
            set_all(tracers, True)
            cpu["all_on"].append(run_phase(loop, tracers, "all_on", args.phase_s))
            cpu["duty_cycled"].append(run_phase(loop, tracers, "duty_cycled", args.phase_s, duty=duty))
            set_all(tracers, False)
        agent_rss = rss_mb()
    finally:
        for t in tracers.values():
            t.close()
        loop.proc.kill()
        loop.proc.wait()
        for f in (go, go + ".ready"):
            if os.path.exists(f):
                os.remove(f)
    med = {k: statistics.median(v) for k, v in loop.rates.items() if k in
           ("calib_off", "calib_on", "untraced", "all_on", "duty_cycled")}
    base = med["untraced"]
    result = {
        "what": "steps/s of a real PyTorch CPU training loop (2x Linear, relu, matmul, mse_loss, backward, SGD; "
                "1 thread) under Debian python3.11, traced by PythonTracer (functions+gc) and TorchTracer (ops)",
        "phase_s": args.phase_s, "rounds": args.rounds, "budget": BUDGET,
        "steps_per_s_median": med, "steps_per_s_samples": {k: loop.rates.get(k, []) for k in med},
        "ratio_all_on": med["all_on"] / base, "ratio_duty_cycled": med["duty_cycled"] / base,
        "slowdown_all_on_pct": 100 * (1 - med["all_on"] / base),
        "slowdown_duty_cycled_pct": 100 * (1 - med["duty_cycled"] / base),
        "duty_fraction": duty, "hits_per_step_all_on": hits_on / steps_on if steps_on else 0,
        "cost_per_hit_us": cost_per_hit * 1e6,
        "agent": {"rss_mb": round(agent_rss, 1), "cpu_pct_all_on": round(statistics.mean(cpu["all_on"]), 2),
                  "cpu_pct_duty_cycled": round(statistics.mean(cpu["duty_cycled"]), 2)},
        "host": {"cpus": os.cpu_count(), "kernel": os.uname().release, "note": "2 shared vCPUs; other work ran"},
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "steps_per_s_samples"}, indent=2))


if __name__ == "__main__":
    main()
