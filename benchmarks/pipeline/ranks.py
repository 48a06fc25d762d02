"""Ranks one worker scores at 1 s windows: the worker's processor (no store: it publishes features,
scores, anomalies, diagnoses and model states to a real broker and waits for the acks, as the worker
does), fed scoring_bench's fleet (8 ranks a node; per node and 0.5 s tick one nccl, one cuda and one
host batch) window by window as fast as it takes them. A step is one window: handle every message
of its two ticks, then flush. The input Kafka hop is not in this number (the drain and paced phases
measure it). Run as a child (`python -m pipeline.ranks`, from benchmarks/) so its RSS is the
worker's alone; prints one JSON line."""
from __future__ import annotations

import os

for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"  # one BLAS thread: the worker is one process per core

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from fleetscope.config import Config  # noqa: E402
from fleetscope.topics import prepare_topics  # noqa: E402
from fleetscope.wire import encode  # noqa: E402
from fleetscope.streams.processor import MessageRef, StreamProcessor  # noqa: E402
from fleetscope.streams.worker import derived_producer, state_reader  # noqa: E402
from scoring_bench import SEC, TICK, Fleet  # noqa: E402


def vm_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def run(bootstrap: str, prefix: str, n_ranks: int, windows: int, warmup: int) -> dict:
    cfg = Config(data_dir=Path(tempfile.mkdtemp(prefix="fs-ranks-")), kafka=bootstrap, topic_prefix=prefix,
                 consumer_group=f"{prefix}-streams", window_s=1.0, allowed_lateness_s=0.5, idle_close_s=3600,
                 warmup_windows=warmup, step_hold_s=3600)
    prepare_topics(cfg, bootstrap)
    states = state_reader(cfg, bootstrap)
    proc = StreamProcessor(cfg, producer=derived_producer(cfg, bootstrap), states=states)
    fleet = Fleet(n_ranks, 8, straggler=7, onset_window=warmup + 3)
    t0 = (time.time_ns() // SEC - windows - 5) * SEC  # in the past, inside every time bound
    steps, offset = [], 0
    try:
        for w in range(windows):
            encoded = [encode(b) for k in (0, 1) for b in fleet.tick(t0 + (2 * w + k) * TICK + TICK // 2, w)]
            c_wall, c_cpu = time.perf_counter(), time.process_time()
            for value in encoded:
                proc.handle(value, None, MessageRef(cfg.raw_topic("host"), 0, offset))
                offset += 1
            proc.flush()
            steps.append({"wall_s": time.perf_counter() - c_wall, "cpu_s": time.process_time() - c_cpu})
        snap = proc.snapshot()
    finally:
        states.close()
    steady = steps[warmup + 1:] if len(steps) > warmup + 4 else steps[len(steps) // 2:]
    wall = [s["wall_s"] for s in steady]
    cpu = [s["cpu_s"] for s in steady]
    return {"ranks": n_ranks, "nodes": len(fleet.nodes), "windows_fed": windows, "warmup_windows": warmup,
            "steps_in_stats": len(steady), "messages_per_window": len(encoded),
            "step_wall_s": {"p50": round(float(np.percentile(wall, 50)), 4), "p99": round(float(np.percentile(wall, 99)), 4),
                            "max": round(max(wall), 4)},
            "step_cpu_s_p50": round(float(np.percentile(cpu, 50)), 4),
            "rss_mb": round(vm_kb("VmRSS") / 1024, 1), "rss_mb_peak": round(vm_kb("VmHWM") / 1024, 1),
            "processor": {k: snap.get(k) for k in ("windows_out", "model_scored", "model_anomalies", "model_diagnoses",
                                                   "dlq", "late_events", "publish_errors")}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=8)
    a = ap.parse_args(argv)
    gc.collect()
    print(json.dumps(run(a.bootstrap, a.prefix, a.ranks, a.windows, a.warmup)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
