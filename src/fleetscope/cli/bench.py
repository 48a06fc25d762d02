"""`fleetscope bench scenario FILE...`: run fault scenarios end to end and score detection.

Results: <out>/scenarios/<name>.json and .png per scenario, and <out>/scenarios.json with
every scenario's latest result and the summary over them (a re-run of one scenario
replaces only its own entry). A table is printed at the end.
"""
from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

from fleetscope.eval.scorer import Score, summarize


def _fmt(v, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def results_table(results: list[dict]) -> str:
    head = ("scenario", "fault", "P", "R", "F1", "FPR", "delay(w)", "KB top", "expected KB", "KB ok")
    rows = [head]
    for r in results:
        if "skipped" in r:
            rows.append((r["scenario"], "-", "-", "-", "-", "-", "-", "skipped", r["skipped"][:60], "-"))
            continue
        if "error" in r:
            rows.append((r["scenario"], "-", "-", "-", "-", "-", "-", "error", r["error"][:60], "-"))
            continue
        s = r["score"]
        rows.append((r["scenario"], r["fault"]["kind"], _fmt(s["precision"]), _fmt(s["recall"]), _fmt(s["f1"]),
                     _fmt(s["false_positive_rate"], 3), _fmt(s["detection_delay_windows"]),
                     _fmt(s["top_kb_entry"]), _fmt(s["expected_kb_entry"]), _fmt(s["kb_match"])))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary_of(results: dict[str, dict]) -> dict:
    ran = {n: r for n, r in results.items() if "score" in r}
    scores = {n: Score(**{k: v for k, v in r["score"].items()}) for n, r in ran.items()}
    healthy = {n for n, r in ran.items() if r["fault"]["kind"] == "none"}
    out = summarize(scores, healthy)
    strict = {n: Score(**r["score_strict"]) for n, r in ran.items() if "score_strict" in r}
    if len(strict) == len(scores):  # the same runs with every peer and after-fault window negative
        out["strict"] = {k: v for k, v in summarize(strict, healthy).items()
                         if k in ("precision", "recall", "f1", "healthy_flagged_frac")}
    out["by_rule"] = rules_summary(ran)
    out["skipped"] = sorted(n for n, r in results.items() if "skipped" in r)
    out["errors"] = sorted(n for n, r in results.items() if "error" in r)
    out["goals"] = {"f1_min": 0.9, "healthy_flagged_frac_max": 0.01, "median_delay_windows_max": 3}
    return out


def rules_summary(ran: dict[str, dict]) -> dict:
    """Each replayed ensemble rule pooled over the runs: fault-run P/R/F1, healthy flagged share."""
    out = {}
    rules = sorted({k for r in ran.values() for k in r.get("rules", {})})
    for rule in rules:
        tp = fp = fn = hfp = hall = 0
        for r in ran.values():
            x = r.get("rules", {}).get(rule)
            if x is None:
                continue
            if r["fault"]["kind"] == "none":
                hfp += x["fp"]
                hall += r["score"]["fp"] + r["score"]["tn"]  # the negatives do not depend on the rule
            else:
                tp, fp, fn = tp + x["tp"], fp + x["fp"], fn + x["fn"]
        p = tp / (tp + fp) if tp + fp else None
        rc = tp / (tp + fn) if tp + fn else None
        out[rule] = {"precision": p, "recall": rc, "f1": 2 * p * rc / (p + rc) if p and rc else None,
                     "healthy_flagged_frac": hfp / hall if hall else None}
    return out


def merge_results(path: Path, new: list[dict]) -> dict:
    doc = {"scenarios": {}}
    if path.exists():
        try:
            doc = json.loads(path.read_text())
        except ValueError:
            print(f"warning: {path} is not valid JSON; starting it afresh", file=sys.stderr)
    doc.setdefault("scenarios", {})
    for r in new:
        doc["scenarios"][r["scenario"]] = r
    doc["summary"] = summary_of(doc["scenarios"])
    doc["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=float) + "\n")
    return doc


def _terminate_as_interrupt(signum, frame):
    raise KeyboardInterrupt


def run_in_child(scenario_path: Path, opts: dict, log_path: Path, show=print) -> dict:
    """Run one scenario in a fresh `python -m fleetscope.eval.run_one` process; relay its progress."""
    import subprocess
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        child = subprocess.Popen([sys.executable, "-m", "fleetscope.eval.run_one", str(scenario_path),
                                  json.dumps(opts)], stdout=subprocess.PIPE, stderr=log, text=True)
    result_file = None
    try:
        for line in child.stdout:
            line = line.rstrip("\n")
            if line.startswith("RESULT "):
                result_file = Path(line[7:])
            else:
                show(time.strftime("%H:%M:%S ") + line)
        child.wait()
    except KeyboardInterrupt:  # Ctrl-C reached the child too (same process group); SIGTERM may not have
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
        try:
            child.wait(90)  # it undoes the fault and stops the stack
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        raise
    finally:
        child.stdout.close()
    if child.returncode != 0 or result_file is None:
        raise RuntimeError(f"the scenario run exited with code {child.returncode}; its log: {log_path}")
    return json.loads(result_file.read_text())


def cmd_bench_scenario(args) -> int:
    from fleetscope.eval.scenario import ScenarioError, load_scenarios
    try:
        scenarios = load_scenarios(args.files)
    except ScenarioError as e:
        print(f"fleetscope bench: {e}", file=sys.stderr)
        return 2
    if not scenarios:
        print("fleetscope bench: no scenario files given (a directory means its *.yaml)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminate_as_interrupt)  # clean up on kill as on Ctrl-C
    out = Path(args.out)
    opts = {"out_dir": str(out / "scenarios"), "ranks": args.ranks, "window_s": args.window_s,
            "warmup_windows": args.warmup_windows, "keep_data": args.keep_data, "work_dir": args.work_dir,
            "config": getattr(args, "config", None)}
    if args.detect_rule:
        opts["extra"] = {"detect_rule": args.detect_rule}
    results = []
    try:
        for i, s in enumerate(scenarios, 1):
            print(f"=== scenario {i}/{len(scenarios)}: {s.name} ({s.path})", flush=True)
            try:
                results.append(run_in_child(s.path, opts, out / "scenarios" / f"{s.name}.log"))
            except KeyboardInterrupt:
                raise
            except Exception as e:  # one broken scenario must not lose the others' results
                print(f"[{s.name}] FAILED: {e}", file=sys.stderr, flush=True)
                results.append({"scenario": s.name, "file": str(s.path), "error": str(e)})
    except KeyboardInterrupt:
        print("interrupted: faults undone and processes stopped; results so far are kept", file=sys.stderr)
    if results:
        doc = merge_results(out / "scenarios.json", results)
        print()
        print(results_table(results))
        print()
        print("summary over every scenario in " + str(out / "scenarios.json") + ":")
        print(json.dumps(doc["summary"], indent=1, default=float))
    return 0 if results and not any("error" in r for r in results) else 1


def register(sub) -> None:
    bench = sub.add_parser("bench", help="evaluation: run fault scenarios and score detection")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    sc = bsub.add_parser("scenario", help="run scenario files (benchmarks/scenarios/*.yaml) end to end")
    sc.add_argument("files", nargs="+", help="scenario YAML files or directories of them")
    sc.add_argument("--out", default="benchmarks/results", help="results directory (default: benchmarks/results)")
    sc.add_argument("--ranks", type=int, help="override the scenarios' rank count")
    sc.add_argument("--window-s", type=float, help="override the scenarios' window length")
    sc.add_argument("--warmup-windows", type=int, help="model warm-up windows (default: the config's)")
    sc.add_argument("--work-dir", help="where each run's data dir goes (default: a temp dir, removed)")
    sc.add_argument("--keep-data", action="store_true", help="keep each run's data dir (logs, chDB)")
    sc.add_argument("--detect-rule", help="ensemble rule that decides (default: the config's detect_rule)")
    sc.set_defaults(func=cmd_bench_scenario)
