"""Steps the ranks one worker scores at 1 s windows (pipeline.ranks, one child process per step) until
a step's p99 passes --ranks-p99-s; reports the largest that met it and the worker's RSS there."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from pipeline.stack import log

BENCH_DIR = Path(__file__).resolve().parents[1]


def step_ranks(args, bootstrap: str, run_id: str, deadline: float) -> dict:
    steps = []
    for n in [int(x) for x in args.ranks.split(",")]:
        if time.monotonic() + 120 > deadline:
            log(f"time budget spent: no ranks step at {n}")
            break
        cmd = [sys.executable, "-m", "pipeline.ranks", "--bootstrap", bootstrap, "--prefix", f"{run_id}r{n}",
               "--ranks", str(n), "--windows", str(args.ranks_windows), "--warmup", str(args.ranks_warmup)]
        p = subprocess.run(cmd, cwd=BENCH_DIR, capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            steps.append({"ranks": n, "error": p.stderr.strip().splitlines()[-1:]})
            log(f"ranks {n}: failed: {p.stderr[-2000:]}")
            break
        step = json.loads(p.stdout.strip().splitlines()[-1])
        step["meets_p99"] = step["step_wall_s"]["p99"] <= args.ranks_p99_s
        steps.append(step)
        log(f"ranks {n}: step p50/p99 {step['step_wall_s']['p50']}/{step['step_wall_s']['p99']} s, "
            f"RSS {step['rss_mb']} MB -> {'meets' if step['meets_p99'] else 'misses'} p99 <= {args.ranks_p99_s} s")
        if not step["meets_p99"]:
            break
    best = max((s for s in steps if s.get("meets_p99")), key=lambda s: s["ranks"], default=None)
    return {"steps": steps, "ranks_per_worker_at_1s": best["ranks"] if best else None,
            "worker_rss_mb_at_that_load": best["rss_mb"] if best else None,
            "worker_rss_mb_peak_at_that_load": best["rss_mb_peak"] if best else None}
