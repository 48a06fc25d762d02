"""The stream worker's per-step CPU without the store: decode, window fold, close, features.

The 1,000-rank feed of scoring_bench.py (per node and 0.5 s tick one nccl, one
cuda and one host batch; 125 nodes) goes through decode + validate, then
WindowAssembler.add, then pop_closed and window_features, window by window,
as StreamProcessor does between its inserts. Times are CPU seconds of this
process (time.process_time), so other work on a shared machine inflates them
little; the steady state leaves out the first windows.

`--code DIR` runs another checkout's streams/ and fleetscope/ (put on PYTHONPATH by --compare; it must be
importable as `fleetscope.streams`, so checkouts from before the one-namespace layout are not comparable) (e.g. a
`git archive` of an older commit) through the same feed. `--compare DIR
--pairs N` alternates N runs of DIR and of this checkout in subprocesses and
writes both, with before/after ratios of the medians, to --out.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("decode_validate", "fold", "pop_closed", "window_features", "total", "of_which_gc")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=1000)
    p.add_argument("--windows", type=int, default=12)
    p.add_argument("--skip", type=int, default=2, help="first windows left out of the stats")
    p.add_argument("--code", default=str(ROOT), help="checkout whose streams/ and fleetscope/ run")
    p.add_argument("--profile", help="write a cProfile of the timed part here")
    p.add_argument("--compare", help="before/after: alternate runs of this checkout and this one")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--before-label", default="", help="what --compare's checkout is (e.g. its commit)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "window_fold.json"))
    p.add_argument("--gc-freeze", action="store_true",
                   help="gc.freeze() once the feed is built (what a worker could do after its start-up)")
    args = p.parse_args(argv)
    if args.compare:
        return compare(args)
    # another checkout's code arrives through PYTHONPATH, set by compare() for its child
    import numpy as np

    from fleetscope.schema import validate
    from fleetscope.wire import decode, encode
    from fleetscope.streams.features import window_features
    from fleetscope.streams.windows import WindowAssembler
    from scoring_bench import SEC, TICK, Fleet

    fleet = Fleet(args.ranks, 8, straggler=7, onset_window=10**9)
    t0 = 1_800_000_000 * SEC
    feed = [[encode(b) for k in (0, 1) for b in fleet.tick(t0 + (2 * w + k) * TICK + TICK // 2, w)]
            for w in range(args.windows)]
    wa = WindowAssembler(1.0, 0.5, 3600)
    if args.gc_freeze:
        gc.freeze()
    gc_s = [0.0]
    gc_start = [0.0]

    def gc_clock(phase, info):  # time spent in the cyclic garbage collector, part of the stages' CPU
        if phase == "start":
            gc_start[0] = time.process_time()
        else:
            gc_s[0] += time.process_time() - gc_start[0]
    gc.callbacks.append(gc_clock)
    prof = None
    if args.profile:
        import cProfile
        prof = cProfile.Profile()
    steps = []
    for w, messages in enumerate(feed):
        if prof is not None and w == args.skip:
            prof.enable()
        gc_s[0] = 0.0
        c0 = time.process_time()
        batches = [decode(value, None) for value in messages]
        for batch in batches:
            validate(batch)
        cd = time.process_time()
        for ref, batch in enumerate(batches):
            wa.add(batch, ref)
        c1 = time.process_time()
        closed = wa.pop_closed()
        c2 = time.process_time()
        vectors = [window_features(x) for x in closed]
        c3 = time.process_time()
        steps.append({"decode_validate": cd - c0, "fold": c1 - cd, "pop_closed": c2 - c1, "window_features": c3 - c2,
                      "total": c3 - c0, "of_which_gc": gc_s[0], "windows": len(closed), "features": sum(len(v) for v in vectors)})
    if prof is not None:
        prof.disable()
        prof.dump_stats(args.profile)
    steady = steps[args.skip:-1]  # the last window's features run on the next step
    out = {"code": args.code, "gc_freeze": args.gc_freeze, "ranks": args.ranks, "messages_per_window": len(feed[0]),
           "windows_per_step": steady[0]["windows"], "features_per_step": steady[0]["features"],
           "clock": "process_time", "steps": len(steady),
           "cpu_s_median": {k: round(float(np.median([s[k] for s in steady])), 4)
                            for k in STAGES},
           "cpu_s_mean": {k: round(float(np.mean([s[k] for s in steady])), 4) for k in STAGES}}
    print(json.dumps(out))
    return out


def compare(args) -> dict:
    import os
    import subprocess

    import numpy as np
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(args.pairs):
        for label, code in (("before", args.compare), ("after", str(ROOT))):
            cmd = [sys.executable, __file__, "--code", code, "--ranks", str(args.ranks),
                   "--windows", str(args.windows), "--skip", str(args.skip)]
            env = {**os.environ, "PYTHONPATH": code} if code != str(ROOT) else None
            runs[label].append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True,
                                                         env=env).stdout))
    med = {label: {k: round(float(np.median([r["cpu_s_median"][k] for r in rs])), 4) for k in STAGES}
           for label, rs in runs.items()}
    out = {"what": "CPU s per 1 s window step at 1,000 ranks (750 messages, 1,125 windows): decode+validate, "
                   "window fold, close, features; median over steps, then over alternating runs",
           "before_code": args.before_label or args.compare, "pairs": args.pairs, "loadavg": [round(x, 2) for x in os.getloadavg()],
           "median_cpu_s": med,
           "before_over_after": {k: round(med["before"][k] / med["after"][k], 2) for k in STAGES
                                 if med["after"][k] > 0 and k != "of_which_gc"},
           "runs": runs}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("median_cpu_s", "before_over_after")}))
    return out


if __name__ == "__main__":
    main()
