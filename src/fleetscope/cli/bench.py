"""`fleetscope bench scenario FILE|DIR... --repeats N`: run fault scenarios end to end and score detection.

Each scenario runs N times, one after another (parallel runs on 2 cores would measure each
other), with different seeds and start offsets, the last repeat with a busy loop beside it.
Results: <out>/scenarios/<name>[-r<i>].json and .png per run, and <out>/scenarios.json with
every scenario's latest repeats, their mean / worst / spread, and the pooled summary
(summary.strict.f1 and summary.strict.f1_worst, ...; per split dev/test under by_split).
A re-run of one scenario replaces only its own entry. A table is printed at the end.
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
    head = ("scenario", "rep", "faults", "impact%", "P", "R", "F1", "job F1", "FP", "delay(w)", "KB top",
            "expected KB", "KB ok")
    rows = [head]
    for r in results:
        if "skipped" in r or "error" in r:
            why = "skipped" if "skipped" in r else "error"
            rows.append((r["scenario"], r.get("repeat", 0), "-", "-", "-", "-", "-", "-", "-", "-", why,
                         r[why][:60], "-"))
            continue
        s = r["score"]
        kinds = ",".join(f["kind"] for f in r["faults"]) or "none"
        impact = ",".join(_fmt(x, 0) for x in r["impact_pct"]) or "-"
        rows.append((r["scenario"], r.get("repeat", 0), kinds, impact, _fmt(s["precision"]), _fmt(s["recall"]),
                     _fmt(s["f1"]), _fmt(s["job_f1"]), s["fp"], _fmt(s["detection_delay_windows"]),
                     _fmt(s["top_kb_entry"]), _fmt(s["expected_kb_entry"]), _fmt(s["kb_match"])))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# Which way is worse for each summary number: the worst repeat is the min or the max.
HIGHER_IS_BETTER = {"f1", "precision", "recall", "kb_hit_rate", "job_f1"}


def _stats(values: list, key: str) -> dict:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"mean": None, "worst": None, "spread": None, "n": 0}
    worst = min(vals) if key in HIGHER_IS_BETTER else max(vals)
    return {"mean": sum(vals) / len(vals), "worst": worst, "spread": max(vals) - min(vals), "n": len(vals)}


def _scenario_stats(repeats: list[dict]) -> dict:
    """Mean, worst repeat and spread of one scenario's numbers over its repeats."""
    ran = [r for r in repeats if "score" in r]
    out = {"repeats": len(repeats), "ran": len(ran)}
    if not ran:
        return out
    get = {"f1": lambda s: s["f1"], "precision": lambda s: s["precision"], "recall": lambda s: s["recall"],
           "job_f1": lambda s: s["job_f1"], "fp": lambda s: s["fp"],
           "healthy_flagged_frac": lambda s: s["false_positive_rate"],
           "delay_windows": lambda s: s["detection_delay_windows"],
           "kb_hit_rate": lambda s: s["kb_hits"] / s["kb_faults"] if s["kb_faults"] else None}
    for k, fn in get.items():
        out[k] = _stats([fn(r["score"]) for r in ran], k)
    nfaults = len(ran[0]["faults"])
    out["impact_pct"] = [_stats([r["impact_pct"][i] for r in ran if i < len(r["impact_pct"])], "impact")["mean"]
                         for i in range(nfaults)]
    out["fault_verdicts"] = [sorted({r["faults"][i]["verdict"] for r in ran if i < len(r["faults"])})
                             for i in range(nfaults)]
    return out


def _split_of(result: dict) -> str:
    parts = Path(result.get("file", "")).parts
    return "test" if "test" in parts else "dev" if "dev" in parts else "other"


def pooled_summary(by_scenario: dict[str, list[dict]], key: str = "score") -> dict:
    """Pooled numbers per repeat index (repeat i of every scenario together), then their mean
    and worst repeat: summary.strict.f1 and summary.strict.f1_worst, and so on.

    Only the repeat indices that every scenario has are pooled: where one scenario ran three times and the
    others once, repeats 1 and 2 would be pools of that one scenario alone, and their mean no pooled number
    (a dev set run once, with one new scenario run three times, read 0.94 for a pool of 0.82). The repeats
    left out are named in `repeats_left_out`; each scenario's own stats keep all of them."""
    n = min((len(v) for v in by_scenario.values() if v), default=0)
    left_out = {name: len(v) - n for name, v in sorted(by_scenario.items()) if len(v) > n}
    per_repeat = []
    for i in range(n):
        ran = {name: reps[i] for name, reps in by_scenario.items() if i < len(reps) and key in reps[i]}
        if not ran:
            continue
        scores = {name: Score.from_dict(r[key]) for name, r in ran.items()}
        per_repeat.append(summarize(scores, {name for name, r in ran.items() if r["healthy"]}))
    out: dict = {"repeats_pooled": len(per_repeat), "repeats_left_out": left_out}

    def put(target: dict, name: str, values: list, better_high: bool) -> None:
        vals = [v for v in values if v is not None]
        target[name] = sum(vals) / len(vals) if vals else None
        target[f"{name}_worst"] = (min(vals) if better_high else max(vals)) if vals else None
        target[f"{name}_spread"] = (max(vals) - min(vals)) if vals else None

    strict: dict = {}
    for k in ("f1", "precision", "recall"):
        put(strict, k, [p[k] for p in per_repeat], True)
    out["strict" if key == "score" else "lenient"] = strict
    job: dict = {}
    put(job, "f1", [p["job"]["f1"] for p in per_repeat], True)
    out["job"] = job
    put(out, "kb_hit_rate", [p["kb_hit_rate"] for p in per_repeat], True)
    put(out, "healthy_flagged_frac", [p["healthy_flagged_frac"] for p in per_repeat], False)
    put(out, "median_delay_windows", [p["median_delay_windows"] for p in per_repeat], False)
    put(out, "p90_delay_s", [p["p90_delay_s"] for p in per_repeat], False)
    out["undetected_any_repeat"] = sorted({u for p in per_repeat for u in p["undetected"]})
    return out


def summary_of(doc_scenarios: dict[str, dict]) -> dict:
    by_scenario = {n: e["repeats"] for n, e in doc_scenarios.items()}
    out = pooled_summary(by_scenario)
    out["lenient"] = pooled_summary(by_scenario, "score_lenient")["lenient"]
    out["by_split"] = {}
    for split in ("dev", "test", "other"):
        part = {n: reps for n, reps in by_scenario.items() if reps and _split_of(reps[0]) == split}
        if part:
            out["by_split"][split] = {**pooled_summary(part), "scenarios": sorted(part)}
    out["impact_pct"] = {n: e["stats"].get("impact_pct") for n, e in doc_scenarios.items()}
    out["skipped"] = sorted(n for n, reps in by_scenario.items() if any("skipped" in r for r in reps))
    out["errors"] = sorted(n for n, reps in by_scenario.items() if any("error" in r for r in reps))
    out["by_rule"] = rules_summary({f"{n}#{i}": r for n, reps in by_scenario.items()
                                    for i, r in enumerate(reps) if "score" in r})
    out["scoring"] = ("strict: every culprit flag (a flag not labelled waiting) on a rank that is not a culprit "
                      "is a false positive; lenient: non-culprit ranks' windows during a fault are not counted")
    return out


def rules_summary(ran: dict[str, dict]) -> dict:
    """Each replayed ensemble rule pooled over the runs: fault-run P/R/F1, healthy flagged share."""
    out = {}
    rules = sorted({k for r in ran.values() for k in r.get("rules", {})})
    for rule in rules:
        tp = fp = fn = hfp = hall = 0
        for r in ran.values():
            x = r.get("rules", {}).get(rule)
            if x is None or "not_run" in x:
                continue
            if r["healthy"]:
                hfp += x["fp"]
                hall += r["score"]["fp"] + r["score"]["tn"]  # the negatives do not depend on the rule
            else:
                tp, fp, fn = tp + x["tp"], fp + x["fp"], fn + x["fn"]
        if not any("not_run" not in r.get("rules", {}).get(rule, {"not_run": ""}) for r in ran.values()):
            out[rule] = {"not_run": "no run ran its detectors"}
            continue
        p = tp / (tp + fp) if tp + fp else None
        rc = tp / (tp + fn) if tp + fn else None
        out[rule] = {"precision": p, "recall": rc, "f1": 2 * p * rc / (p + rc) if p and rc else None,
                     "healthy_flagged_frac": hfp / hall if hall else None}
    return out


def merge_results(path: Path, new: dict[str, list[dict]]) -> dict:
    """Replace each rerun scenario's entry (all its repeats); keep the others; recompute the summary."""
    doc = {"scenarios": {}}
    if path.exists():
        try:
            doc = json.loads(path.read_text())
        except ValueError:
            print(f"warning: {path} is not valid JSON; starting it afresh", file=sys.stderr)
    old = doc.setdefault("scenarios", {})
    for name in list(old):
        if "repeats" not in old[name]:  # a result of the single-run format: not comparable, dropped
            del old[name]
    for name, repeats in new.items():
        old[name] = {"repeats": repeats, "stats": _scenario_stats(repeats)}
    doc["summary"] = summary_of(old)
    doc["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=float) + "\n")
    return doc


def repeat_plan(n: int) -> list[dict]:
    """Seeds, start offsets and load per repeat: every repeat differs; with 2+ repeats the last
    runs with a busy-loop process beside it (a loaded machine)."""
    return [{"repeat": i, "seed": i, "start_offset_s": float(3 * i), "busy_loops": 1 if n > 1 and i == n - 1 else 0}
            for i in range(n)]


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
        for s in (signal.SIGINT, signal.SIGTERM):  # a second signal must not end the wait: the child is cleaning up
            signal.signal(s, signal.SIG_IGN)
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
    if args.repeats < 1:
        print("fleetscope bench: --repeats must be at least 1", file=sys.stderr)
        return 2
    from fleetscope.cli.common import stop_on_interrupt_or_terminate
    stop_on_interrupt_or_terminate()  # clean up on kill as on Ctrl-C
    out = Path(args.out)
    base = {"out_dir": str(out / "scenarios"), "ranks": args.ranks, "window_s": args.window_s,
            "warmup_windows": args.warmup_windows, "keep_data": args.keep_data, "work_dir": args.work_dir,
            "config": getattr(args, "config", None)}
    if args.detect_rule:
        base["extra"] = {"detect_rule": args.detect_rule}
    plan = repeat_plan(args.repeats)
    if args.repeats == 1:
        print("note: one repeat measures luck as much as the detector; use --repeats 3 or more for results",
              flush=True)
    results: dict[str, list[dict]] = {}
    total, done, t_start = len(scenarios) * len(plan), 0, time.monotonic()
    try:
        for i, s in enumerate(scenarios, 1):
            for rep in plan:
                eta = ""
                if done:
                    left = (time.monotonic() - t_start) / done * (total - done)
                    eta = f", about {left / 60:.0f} min left"
                print(f"=== scenario {i}/{len(scenarios)} repeat {rep['repeat'] + 1}/{len(plan)}: {s.name} "
                      f"(seed {rep['seed']}, offset {rep['start_offset_s']:g} s, busy loops {rep['busy_loops']}; "
                      f"run {done + 1} of {total}{eta})", flush=True)
                log = out / "scenarios" / f"{s.name}{'-r%d' % rep['repeat'] if rep['repeat'] else ''}.log"
                try:
                    r = run_in_child(s.path, {**base, **rep}, log)
                except KeyboardInterrupt:
                    raise
                except Exception as e:  # one broken scenario must not lose the others' results
                    print(f"[{s.name}] FAILED: {e}", file=sys.stderr, flush=True)
                    r = {"scenario": s.name, "file": str(s.path), "error": str(e), "repeat": rep["repeat"]}
                results.setdefault(s.name, []).append(r)
                done += 1
    except KeyboardInterrupt:
        print("interrupted: faults undone and processes stopped; results so far are kept", file=sys.stderr)
    if results:
        doc = merge_results(out / "scenarios.json", results)
        print()
        print(results_table([r for reps in results.values() for r in reps]))
        print()
        print("summary over every scenario in " + str(out / "scenarios.json") + ":")
        summary = {k: v for k, v in doc["summary"].items() if k != "by_rule"}
        print(json.dumps(summary, indent=1, default=float))
    failed = any("error" in r for reps in results.values() for r in reps)
    return 0 if results and not failed else 1


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
    sc.add_argument("--repeats", type=int, default=3,
                    help="runs per scenario, with different seeds and start offsets; with 2 or more the last "
                         "has a busy loop beside it (default: 3)")
    sc.set_defaults(func=cmd_bench_scenario)
