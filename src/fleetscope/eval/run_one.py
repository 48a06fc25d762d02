"""Run one scenario in this process: `python -m fleetscope.eval.run_one FILE OPTIONS_JSON`.

`fleetscope bench scenario` starts one of these per scenario, so that every run begins
with a clean process (no broker client, BPF program or thread left from the last one).
Progress lines go to stdout; the agent's and libraries' logging goes to stderr, which
the parent sends to a log file. The last stdout line is `RESULT <json file>`.
SIGTERM and SIGINT both undo the fault and stop everything before exiting; signals after the first are ignored.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path


def _interrupt(signum, frame):
    """The first SIGTERM or SIGINT starts the cleanup; later ones are ignored so that they cannot cut it short.
    They come in twos: `timeout`, a CI job's cancel or `kill -- -PGID` signal the whole process group, and
    `fleetscope bench scenario` forwards a SIGTERM of its own. A second KeyboardInterrupt raised inside the
    cleanup (or on the way to it) used to leave the ranks running and the fault's cgroup in place."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv=None) -> int:
    from fleetscope.eval.runner import RunOptions, run_scenario
    from fleetscope.eval.scenario import load_scenario
    from fleetscope import config as config_mod
    argv = sys.argv[1:] if argv is None else argv
    path, raw = argv
    o = json.loads(raw)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    opts = RunOptions(out_dir=Path(o["out_dir"]), ranks=o.get("ranks"), window_s=o.get("window_s"),
                      warmup_windows=o.get("warmup_windows"), keep_data=o.get("keep_data", False),
                      work_dir=Path(o["work_dir"]) if o.get("work_dir") else None,
                      base_config=config_mod.load(o.get("config")), extra=o.get("extra", {}),
                      seed=o.get("seed", 0), start_offset_s=o.get("start_offset_s", 0.0),
                      busy_loops=o.get("busy_loops", 0), repeat=o.get("repeat", 0),
                      progress=lambda line: print(line, flush=True))
    try:
        result = run_scenario(load_scenario(path), opts)
    except KeyboardInterrupt:
        print("interrupted: fault undone, workload and stack stopped", flush=True)
        return 130
    out = opts.out_dir / f"{result.get('result', result['scenario'])}.json"
    if "skipped" in result:
        out = opts.out_dir / (f"{result['scenario']}-r{opts.repeat}.json" if opts.repeat else out.name)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"RESULT {out}", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The run already stopped everything it started (fault, workload, stack). Exit now rather
    # than wait for library threads and atexit hooks (librdkafka reconnect loops of the stopped
    # agent's producer, bcc's uprobe detach on objects already closed) to wind down.
    os._exit(code)
