"""ProcessSampler cost: CPU ms per tick for 8 rank processes, against reading the same files without parsing.

Measures in one run, interleaved in 1 s rounds of 100 ms ticks (the Meter and
round-robin of sampler_cost_bench.py) so a busy neighbour on this shared
machine hits every variant alike:
  - sampler: ProcessSampler over 8 real child processes (RANK set), between
    rescans: read stat, status and io of each, parse, diff, build the batch,
    encode it for the wire;
  - read_files_only: the same 24 files read the same way (open, read, close)
    every tick, nothing else: the floor;
  - sampler_rank_rescan_every_tick: the default targeting (every process with
    a rank) rescanning /proc on every tick, which is what the defaults do
    (sample_interval_s = trace_poll_s = 1 s): one identity check per process
    on the host (cached: a stat read and an exe stat each), plus the sampling.
CPU time is this process's own (time.process_time). Writes results/process_sampler.json.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from sampler_cost_bench import INTERVAL_S, Meter, interleaved  # noqa: E402
from fleetscope.producers.identity import IdentityResolver  # noqa: E402
from fleetscope.producers.process_sampler import ProcessSampler, read_file  # noqa: E402
from fleetscope.producers.tracers.discovery import TargetSpec, all_pids  # noqa: E402

N_PROCS = 8


def start_ranks(n: int) -> list[subprocess.Popen]:
    job = f"bench-{uuid.uuid4().hex[:8]}"
    procs = []
    for rank in range(n):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(n), "FLEETSCOPE_JOB": job}
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], env=env))
    argv_done = lambda p: read_file(f"/proc/{p.pid}/cmdline").startswith(sys.executable.encode())  # noqa: E731
    deadline = time.monotonic() + 10
    while not all(argv_done(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)
    return procs


class ReadOnlyFloor:
    """Reads each target's stat, status and io every tick, and nothing else."""

    def __init__(self, pids):
        self.paths = [f"/proc/{pid}/{name}" for pid in pids for name in ("stat", "status", "io")]

    def sample(self, now_ns):
        for path in self.paths:
            read_file(path)
        return None


def main() -> None:
    seconds = float(os.environ.get("BENCH_SECONDS", "10"))
    procs = start_ranks(N_PROCS)
    try:
        pids = tuple(p.pid for p in procs)
        steady = ProcessSampler("bench", IdentityResolver(host="bench"), targets=TargetSpec(pids=pids),
                                poll_s=3600.0)
        rescan = ProcessSampler("bench", IdentityResolver(host="bench"), poll_s=0.0)
        for s in (steady, rescan):
            s.sample(time.time_ns())  # first scan and first read (gauges only) out of the measurement
        assert set(pids) <= rescan.watcher.current, "the rank scan missed the benchmark's ranks"
        meters = {"sampler": Meter(steady.sample), "read_files_only": Meter(ReadOnlyFloor(pids).sample),
                  "sampler_rank_rescan_every_tick": Meter(rescan.sample)}
        interleaved(meters, seconds)
        results = {"interval_s": INTERVAL_S, "cpus": os.cpu_count(), "seconds_per_variant": seconds,
                   "target_processes": N_PROCS, "processes_on_host": len(all_pids()),
                   "rank_targets_found_by_rescan": len(rescan.watcher.current),
                   **{name: m.result() for name, m in meters.items()}}
        ms = {name: results[name]["cpu_ms_per_tick"] for name in meters}
        results["sampler_ratio_to_read_files_only"] = round(ms["sampler"] / max(ms["read_files_only"], 1e-9), 2)
        results["sampler_us_per_process"] = round(ms["sampler"] * 1000 / N_PROCS, 1)
        results["rescan_every_tick_pct_of_one_core_at_1s"] = round(ms["sampler_rank_rescan_every_tick"] / 10, 3)
        results["stats"] = {"steady": steady.stats(), "rescan": rescan.stats()}
    finally:
        for p in procs:
            p.kill()
            p.wait()
    out = ROOT / "benchmarks" / "results" / "process_sampler.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
