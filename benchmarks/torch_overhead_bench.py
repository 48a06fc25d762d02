"""Overhead of torch op tracing under the agent's real overhead governor, on a real PyTorch CPU training loop.

The loop (tests/workloads/torch_train.py, Debian's python3 with the venv's
torch on PYTHONPATH, 1 thread) prints its steps/s every second. This process
is the agent. Setups, in interleaved rounds (the machine is shared, so drift
and neighbours' load hit all alike):

  untraced       TorchTracer attached to the pid, its "ops" family off: nothing fires;
  governor_<P>s  the agent's TracerManager (producers/tracers/manager.py) with
                 tracers={"torch": TorchTracer(...)} injected, trace_budget=0.01,
                 trace_duty_period_s=P, started on the loop's pid and sampled
                 every second as the agent does; a fresh manager per block;
  all_on         the ops family attached throughout (governor off).

A second, never-traced copy of the loop runs alongside as a control: both
see the same neighbours (this host is 2 shared vCPUs), so the traced loop's
rate relative to the control's, normalised by that relation in the untraced
blocks, is the headline ("vs_control"). Per setup also: steps/s (wall) and
the loop's main-thread CPU time per step (from /proc/<pid>/schedstat), as
plain ratios to the untraced blocks. The probe-hit cost the governor charges comes from the
project's calibration (producers/tracers/calibrate.py), once per run.

Writes benchmarks/results/torch_overhead.json. Run as root:
  .venv/bin/python benchmarks/torch_overhead_bench.py [--rounds 3 --block-s 30]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from fleetscope.config import Config  # noqa: E402
from fleetscope.producers.tracers.calibrate import calibrate_hit_cost_ns  # noqa: E402
from fleetscope.producers.tracers.manager import TracerManager  # noqa: E402
from fleetscope.producers.tracers.torch_ops import TorchTracer  # noqa: E402
from toggle_cost_bench import Loop  # noqa: E402

BUDGET = 0.01


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def sample_for(seconds: float, sample) -> float:
    """Call `sample()` every second for `seconds`; returns this process's CPU % meanwhile."""
    cpu0, t0 = os.times(), time.monotonic()
    while time.monotonic() < t0 + seconds:
        time.sleep(min(1.0, max(t0 + seconds - time.monotonic(), 0)))
        sample()
    cpu1 = os.times()
    return 100 * ((cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)) / (time.monotonic() - t0)


class Loops:
    """The traced loop and its control, entering phases together."""

    def __init__(self, traced: Loop, control: Loop):
        self.traced, self.control = traced, control
        self.pid = traced.pid

    def enter(self, phase: str):
        for lp in (self.traced, self.control):
            lp.phase = "switch"  # the second that straddles the change is not counted
        time.sleep(1.2)
        for lp in (self.traced, self.control):
            lp.phase = phase

    def set_phase(self, phase: str):
        self.traced.phase = self.control.phase = phase

    def totals(self, phase: str) -> dict:
        return self.traced.totals(phase)


def governed_block(loop, name, seconds, period, hit_cost_ns, tmp) -> dict:
    loop.set_phase("setup")  # compiling the tracer's BPF program takes CPU: counted in no setup
    cfg = Config(data_dir=Path(tmp), trace=("torch",), trace_pids=(str(loop.pid),), trace_auto=False,
                 trace_budget=BUDGET, trace_duty_period_s=period, trace_poll_s=1.0)
    manager = TracerManager(cfg, tracers={"torch": TorchTracer("bench")}, hit_cost_ns=hit_cost_ns)
    try:
        loop.enter(name)
        manager.start()
        cpu = sample_for(seconds, lambda: manager.sample(time.time_ns()))
        stats = manager.stats()
    finally:
        manager.close()
    return {"agent_cpu_pct": cpu, "duty": stats.get("trace_duty.torch.ops"),
            "budget_used_frac": stats.get("trace_budget_used_frac"), "errors": stats["trace_errors"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-s", type=float, default=30)
    ap.add_argument("--periods", type=float, nargs="+", default=[30.0, 2.0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/torch_overhead.json"))
    args = ap.parse_args()
    go = tempfile.mktemp(prefix="fleetscope-bench-go-")
    tmp = tempfile.mkdtemp(prefix="fleetscope-bench-")
    hit_cost_ns = calibrate_hit_cost_ns()
    loop = Loops(Loop(go), Loop(go + "-control"))
    for g in (go, go + "-control"):
        while not os.path.exists(g + ".ready"):
            time.sleep(0.05)
    for g in (go, go + "-control"):
        open(g, "w").close()
    tracer = TorchTracer("bench")
    blocks: dict[str, list] = {}
    try:
        assert tracer.add_pid(loop.pid), tracer.unavailable
        tracer.set_family_enabled("ops", False)
        for r in range(args.rounds):
            loop.enter("untraced")
            sample_for(args.block_s, tracer.sample)
            for p in args.periods:
                name = f"governor_{p:g}s"
                # a governed block spans at least two periods: the governor's first period starts at a guess
                info = governed_block(loop, name, max(args.block_s, 2 * p), p, hit_cost_ns, tmp)
                blocks.setdefault(name, []).append(info)
                print(f"round {r} {name}: {info} {loop.totals(name)}", flush=True)
            tracer.set_family_enabled("ops", True)
            loop.enter("all_on")
            blocks.setdefault("all_on", []).append({"agent_cpu_pct": sample_for(args.block_s / 3, tracer.sample)})
            tracer.set_family_enabled("ops", False)
            print(f"round {r}: untraced {loop.totals('untraced')} all_on {loop.totals('all_on')}", flush=True)
        agent_rss = rss_mb()
    finally:
        tracer.close()
        for lp in (loop.traced, loop.control):
            lp.proc.kill()
            lp.proc.wait()
        for f in (go, go + ".ready", go + "-control", go + "-control.ready"):
            if os.path.exists(f):
                os.remove(f)
    names = ["untraced", *(f"governor_{p:g}s" for p in args.periods), "all_on"]
    tot = {n: loop.totals(n) for n in names}
    ctl = {n: loop.control.totals(n) for n in names}

    def rel(n):  # (traced steps/s, traced CPU per step) relative to the control's, in blocks of setup n
        t, c = tot[n], ctl[n]
        return (t["steps"] / t["wall_s"]) / (c["steps"] / c["wall_s"]), \
            (c["cpu_s"] / c["steps"]) / (t["cpu_s"] / t["steps"])
    rel0 = rel("untraced")
    base = tot["untraced"]
    rate0, cpu0 = base["steps"] / base["wall_s"], base["cpu_s"] / base["steps"]
    setups = {}
    for n in names:
        t = tot[n]
        rate, cpu = t["steps"] / t["wall_s"], t["cpu_s"] / t["steps"]
        setups[n] = {"steps_per_s": round(rate, 1), "cpu_us_per_step": round(cpu * 1e6, 1),
                     "steps_per_s_ratio": round(rate / rate0, 4), "cpu_ratio": round(cpu0 / cpu, 4),
                     "slowdown_pct_wall": round(100 * (1 - rate / rate0), 2),
                     "slowdown_pct_cpu": round(100 * (1 - cpu0 / cpu), 2), "measured_s": round(t["wall_s"], 1)}
        r = rel(n)
        setups[n]["vs_control"] = {"steps_per_s_ratio": round(r[0] / rel0[0], 4), "cpu_ratio": round(r[1] / rel0[1], 4),
                                   "slowdown_pct_wall": round(100 * (1 - r[0] / rel0[0]), 2),
                                   "slowdown_pct_cpu": round(100 * (1 - r[1] / rel0[1]), 2),
                                   "control_steps_per_s": round(ctl[n]["steps"] / max(ctl[n]["wall_s"], 1e-9), 1)}
        if n in blocks:
            setups[n]["agent_cpu_pct"] = round(sum(b["agent_cpu_pct"] for b in blocks[n]) / len(blocks[n]), 2)
            setups[n]["blocks"] = blocks[n] if n != "all_on" else len(blocks[n])
    result = {
        "what": "real PyTorch CPU training loop (2x Linear, relu, matmul, mse_loss, backward, SGD; 1 thread, Debian "
                "python3.11) traced by TorchTracer (ops) under the agent's TracerManager/OverheadGovernor",
        "budget": BUDGET, "rounds": args.rounds, "block_s": args.block_s, "hit_cost_ns_calibrated": hit_cost_ns,
        "goal": "<= 2% slowdown with the governor on", "setups": setups, "agent_rss_mb": round(agent_rss, 1),
        "host": {"cpus": os.cpu_count(), "kernel": os.uname().release, "loadavg": os.getloadavg(),
                 "note": "2 shared vCPUs; other engineers' work ran at the same time"},
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
