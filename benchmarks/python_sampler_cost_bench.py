"""What sampled Python stacks cost the traced process: a call-heavy loop's CPU time per call with
no sampler, with py-spy at RATE Hz --nonblocking (what producers/tracers/python_sampler.py runs),
and with py-spy pausing the process per sample (its default), on each interpreter here.

Rounds alternate the conditions so a loaded machine's drift falls on all of them. The loop reports
its own process CPU time per call; py-spy's own CPU (the agent's side) comes from wait4.
Writes benchmarks/results/python_sampler_cost.json. Run as root: py-spy reads another process.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from fleetscope.producers.tracers.python_sampler import find_py_spy

LOOP = """
import sys, time
def leaf(x):
    return x + 1
def mid(n):
    s = 0
    for i in range(n):
        s = leaf(s)
    return s
end = time.monotonic() + float(sys.argv[1])
calls, t0 = 0, time.process_time()
print("started", flush=True)
while time.monotonic() < end:
    mid(10000)
    calls += 10000
print(calls, (time.process_time() - t0) / calls * 1e9, flush=True)
"""


def one_round(python: str, seconds: float, mode: str, rate: int, py_spy: str) -> dict:
    loop = subprocess.Popen([python, "-c", LOOP, str(seconds)], stdout=subprocess.PIPE, text=True)
    assert loop.stdout.readline().strip() == "started"
    spy = None
    if mode != "off":
        cmd = [py_spy, "record", "--pid", str(loop.pid), "--rate", str(rate), "--format", "raw",
               "-o", os.devnull, "--duration", str(int(seconds) + 2)]
        if mode == "nonblocking":
            cmd.append("--nonblocking")
        spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    calls, ns_per_call = loop.stdout.readline().split()
    loop.wait()
    spy_cpu = 0.0
    if spy is not None:
        _, _, usage = os.wait4(spy.pid, 0)
        spy.returncode = 0
        spy_cpu = usage.ru_utime + usage.ru_stime
    return {"calls": int(calls), "cpu_ns_per_call": float(ns_per_call), "py_spy_cpu_s": spy_cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=int, default=49)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results/python_sampler_cost.json"))
    args = ap.parse_args()
    py_spy = find_py_spy()
    pythons = [sys.executable] + (["/usr/bin/python3"] if os.path.exists("/usr/bin/python3") else [])
    modes = ("off", "nonblocking", "blocking")
    result = {"rate_hz": args.rate, "rounds": args.rounds, "seconds": args.seconds,
              "py_spy": subprocess.run([py_spy, "--version"], capture_output=True, text=True).stdout.strip(),
              "interpreters": {}}
    for python in pythons:
        version = subprocess.run([python, "--version"], capture_output=True, text=True).stdout.strip()
        runs = {m: [] for m in modes}
        for _ in range(args.rounds):
            for m in modes:
                runs[m].append(one_round(python, args.seconds, m, args.rate, py_spy))
        med = {m: statistics.median(r["cpu_ns_per_call"] for r in runs[m]) for m in modes}
        result["interpreters"][python] = {
            "version": version,
            "cpu_ns_per_call_median": med,
            "overhead_vs_off": {m: med[m] / med["off"] - 1 for m in modes if m != "off"},
            "py_spy_cpu_share_of_a_core": {m: statistics.median(r["py_spy_cpu_s"] for r in runs[m]) / args.seconds
                                           for m in modes if m != "off"},
            "runs": runs}
        print(version, json.dumps({k: v for k, v in result["interpreters"][python].items() if k != "runs"}), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
