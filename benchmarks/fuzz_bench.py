"""The long fuzz run of the raw-message decoder (CI runs a short one in
tests/test_wire_fuzz.py). Goal: >= 10^6 inputs with no contract break.

    nice -n 19 .venv/bin/python benchmarks/fuzz_bench.py --inputs 1000000 --max-seconds 3600 --workers 2

Runs seeded chunks (in --workers processes) until the input count or the time
cap; records honestly how many inputs ran, by strategy and outcome. Inputs that broke the contract are
written to tests/fuzz_corpus/. Writes benchmarks/results/fuzz.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import platform
import time
from pathlib import Path

import pyarrow as pa

from fleetscope.eval.wire_mutations import STRATEGIES, fuzz

ROOT = Path(__file__).resolve().parents[1]


def run_chunk(inputs: int, seed: int) -> dict:
    """One seeded chunk in a worker process; failures come back as (strategy, bytes, problem)."""
    return fuzz(inputs, seed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inputs", type=int, default=1_000_000)
    ap.add_argument("--max-seconds", type=float, default=3600)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=5000)
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args()
    totals = {s: {"accepted": 0, "rejected": 0, "failed": 0} for s in STRATEGIES}
    failures = []

    def keep(strategy, data, problem):
        name = hashlib.sha1(data).hexdigest()[:16]
        (ROOT / "tests" / "fuzz_corpus" / f"{name}.bin").write_bytes(data)
        failures.append({"strategy": strategy, "problem": problem, "file": f"{name}.bin"})

    ran, chunk_seed, t0 = 0, args.seed, time.perf_counter()
    with multiprocessing.Pool(args.workers) as pool:
        while ran < args.inputs and time.perf_counter() - t0 < args.max_seconds:
            sizes = []
            for _ in range(args.workers):  # one chunk per worker, each with its own seed
                sizes.append(min(args.chunk, args.inputs - ran - sum(sizes)))
            jobs = [(n, chunk_seed + i) for i, n in enumerate(sizes) if n > 0]
            for result in pool.starmap(run_chunk, jobs):
                for s, counts in result["by_strategy"].items():
                    for k, v in counts.items():
                        totals[s][k] += v
                for strategy, data, problem in result["failures"]:
                    keep(strategy, data, problem)
            ran += sum(n for n, _ in jobs)
            chunk_seed += len(jobs)
            print(f"{ran} inputs, {len(failures)} failures, {time.perf_counter() - t0:.0f} s", flush=True)
    elapsed = time.perf_counter() - t0
    out = {"inputs": ran, "goal_inputs": args.inputs, "reached_goal": ran >= args.inputs,
           "seconds": round(elapsed, 1), "inputs_per_s": round(ran / elapsed, 1),
           "seeds": [args.seed, chunk_seed - 1], "workers": args.workers, "failures": failures, "by_strategy": totals,
           "machine": {"python": platform.python_version(), "pyarrow": pa.__version__,
                       "note": "2 shared cores, run at nice 19 beside other work"}}
    path = ROOT / "benchmarks" / "results" / "fuzz.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}: {ran} inputs, {len(failures)} failures")


if __name__ == "__main__":
    main()
