"""Replay a kept scenario run's feature vectors through a job model with other settings.

    python -m fleetscope.eval.replay benchmarks/results/scenarios/*.json --set var_floor=0.25

A run made with `--keep-data` leaves its chDB with every feature vector the stream worker
scored. This reads them back in window order (rank features only, as the worker scores them;
--join-node adds each rank's host features, as the live runs before that change did), feeds a fresh JobModel built from ModelConfig plus the
given overrides, and scores the result against the same ground truth with the same scorer.
It answers "what would this model setting have done on exactly these real runs" without
re-running the workloads. What differs from the live run: nothing about the vectors; the
model sees the same windows in the same order.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from fleetscope.eval.scenario import load_scenario
from fleetscope.eval.scorer import WindowResult, score_run, summarize
from fleetscope.streams.stack_signature import model_input


# A replay scores settings on the very runs it is tuned on: never a default, never a result.
SETTINGS_NOTE = ("settings picked on the scored runs: these numbers are optimistic and must not choose a default; "
                 "choose on benchmarks/scenarios/dev and report benchmarks/scenarios/test")
JOIN_NODE = False  # as streams/scoring.py: the model scores each rank's own features; --join-node for the old way


def load_steps(data_dir: Path, job: str) -> list[tuple[int, list[tuple[int, dict]]]]:
    from fleetscope.store import open_store
    store = open_store(data_dir, prefer_endpoint=False)
    try:
        rows = store.query("SELECT rank, host, toUnixTimestamp64Nano(window_start), feature FROM features FINAL "
                           "WHERE job = {j:String} ORDER BY window_start, rank", {"j": job}).rows
        hosts = sorted({h for _, h, _, _ in rows})
        node = {}
        for h in hosts:
            for ws, f in store.query("SELECT toUnixTimestamp64Nano(window_start), feature FROM features FINAL "
                                     "WHERE tenant = '_node' AND job = {h:String}", {"h": h}).rows:
                node[(h, ws)] = f
    finally:
        store.close()
    steps: dict[int, list[tuple[int, dict]]] = {}
    for rank, host, ws, f in rows:
        vector = {**(node.get((host, ws), {}) if JOIN_NODE else {}), **f}
        steps.setdefault(ws, []).append((rank, model_input(vector)))   # as the worker's model sees it
    return sorted(steps.items())


def replay(result: dict, overrides: dict) -> tuple[list, dict]:
    """(score rows as the runner collects them, the Score dict) for one kept run."""
    from fleetscope.eval.timegrid import ONSET_GRACE_WINDOWS, RECOVERY_GRACE_WINDOWS, window_of
    from fleetscope.streams.model import JobModel, ModelConfig
    cfg = ModelConfig(warmup_windows=result["warmup_windows"], rule=result["detect_rule"], window_s=result["window_s"])
    dspot = {k.split(".", 1)[1]: v for k, v in overrides.items() if k.startswith("dspot.")}
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if not k.startswith("dspot.")})
    model = JobModel(cfg)
    for t in model.thresholds.values():  # dspot.<attr>=value: a DSpot setting (e.g. warm_clip_mads)
        for k, v in dspot.items():
            if not hasattr(t, k):
                raise SystemExit(f"DSpot has no setting {k!r}")
            setattr(t, k, v)
    t0, w = result["t0_unix"], result["window_s"]
    lo, hi = int(t0 * 1e9), int((t0 + result["duration_s"]) * 1e9)
    scores = []
    for ws, rows in load_steps(Path(result["data_dir"]), result["job"]):
        for s in model.process_window(ws, rows):
            if lo <= ws < hi:
                scores.append((s.rank, ws, s.score, s.threshold, s.is_anomaly, s.detectors))
    effects = {i: f.get("impact", {}).get("effect") for i, f in enumerate(result.get("faults", []))}
    truth = replace(load_scenario(result["file"]).truth(effects), ranks=tuple(range(result["ranks"])), window_s=w)
    res = [WindowResult(rank=r, window=window_of(ws, t0, w), flagged=bool(a)) for r, ws, _, _, a, _ in scores]
    sc = score_run(truth, res, onset_grace_s=ONSET_GRACE_WINDOWS * w, recovery_grace_s=RECOVERY_GRACE_WINDOWS * w)
    return scores, sc


def _value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="per-scenario result JSON files of runs made with --keep-data")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a ModelConfig override, or dspot.<attr> for the thresholds")
    p.add_argument("--json", help="write the replayed scores here")
    p.add_argument("--join-node", action="store_true",
                   help="add the host (node) features to the rank vectors, as the worker did before they were left out")
    args = p.parse_args(argv)
    global JOIN_NODE
    JOIN_NODE = args.join_node
    overrides = {k: _value(v) for k, _, v in (s.partition("=") for s in args.set)}
    scores, healthy, out = {}, set(), {}
    for path in args.results:
        result = json.loads(Path(path).read_text())
        if not result.get("data_dir") or not result.get("t0_unix") or "score" not in result:
            print(f"{path}: not a kept run (no data_dir/t0_unix); skipped")
            continue
        _, sc = replay(result, overrides)
        scores[result["scenario"]] = sc
        if result.get("healthy", result.get("fault", {}).get("kind") == "none"):
            healthy.add(result["scenario"])
        out[result["scenario"]] = sc.as_dict()
        live = result["score"]
        print(f"{result['scenario']:28s} replay P {sc.precision} R {sc.recall} F1 {sc.f1} FPR "
              f"{sc.false_positive_rate} delay {sc.detection_delay_windows} | live F1 {live['f1']} "
              f"FPR {live['false_positive_rate']}")
    summary = summarize(scores, healthy)
    print(json.dumps({"overrides": overrides, "summary": summary}, default=float))
    if args.json:
        Path(args.json).write_text(json.dumps({"note": "diagnoses are not replayed: kb_* fields say nothing",
                                               "settings_note": SETTINGS_NOTE,
                                               "overrides": overrides, "scenarios": out, "summary": summary},
                                              indent=1, default=float) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
