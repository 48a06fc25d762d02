"""`fleetscope demo`: the whole pipeline on this machine, with one injected fault, in a few minutes.

It starts the embedded stack (broker, streams worker, agent with eBPF tracing, chDB), runs
three ranks of real PyTorch DDP training on the CPU under torchrun, waits for the job's
model to warm up, then makes one rank a straggler (a CPU quota; without root: a slow input
pipeline), and shows progress while it runs. At the end it prints what fleetscope detected
and when, next to the truth, and writes a plot of the anomaly score per rank.
No configuration: everything lives in a temporary data dir that is removed afterwards.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from fleetscope.resources import package_dir

DEMO_DIR = package_dir("fleetscope.eval.scenarios")
DEMO_WARMUP_WINDOWS = 15


def demo_scenario() -> Path:
    """The straggler scenario when this host can cap a rank's CPU, else the input-stall one."""
    from fleetscope.eval.cgroups import CgroupUnavailable, controller_root
    if os.geteuid() == 0:
        try:
            controller_root("cpu")
            return DEMO_DIR / "demo_straggler.yaml"
        except CgroupUnavailable:
            pass
    return DEMO_DIR / "demo_dataloader.yaml"


def _spans(windows: list[int]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for k in sorted(set(windows)):
        if out and k == out[-1][1] + 1:
            out[-1][1] = k
        else:
            out.append([k, k])
    return [(a, b) for a, b in out]


def report(result: dict) -> str:
    """What was detected and when, next to the truth, in plain lines."""
    w = result["window_s"]
    f, s = result["faults"][0], result["score"]  # the demo scenarios have one fault
    culprits = f["expect"]["ranks"]
    lines = ["", "=== fleetscope demo: what happened", "",
             f"truth:    {f['kind']} on rank {','.join(map(str, culprits))} from {f['start_s']:.0f} s to "
             f"{f['start_s'] + f['duration_s']:.0f} s (seconds after warm-up; windows of {w:g} s)"]
    for burst in f.get("injected", []):
        lines.append(f"          injected at {burst.get('on_s', float('nan')):.1f} s, "
                     f"removed at {burst.get('off_s', float('nan')):.1f} s")
    if f["impact"].get("impact_pct") is not None:
        lines.append(f"          measured impact on the step rate: {f['impact']['impact_pct']:+.0f}% "
                     f"({f['verdict']})")
    lines.append(f"          expected diagnosis: {f['expect']['kb_entry']}")
    lines.append("")
    by_rank: dict[int, list[int]] = {}
    roles: dict[int, dict[str, int]] = {}    # per rank: windows per role (culprit, waiting, node, job)
    for fw in result["flagged_windows"]:
        by_rank.setdefault(fw["rank"], []).append(fw["window"])
        role = fw.get("role") or "culprit"   # a store without roles: every flag is the rank's own
        roles.setdefault(fw["rank"], {})[role] = roles.get(fw["rank"], {}).get(role, 0) + 1
    if not by_rank:
        lines.append("detected: nothing was flagged")
    named = sorted(r for r, by_role in roles.items() if by_role.get("culprit"))
    if named:
        lines.append(f"culprit:  rank {','.join(map(str, named))} (the rank its peers wait for, or at fault itself)")
    for rank in sorted(by_rank):
        spans = ", ".join(f"{a * w:.0f}-{(b + 1) * w:.0f} s" for a, b in _spans(by_rank[rank]))
        what = "; ".join(f"{n} {_role_words(role, named)}" for role, n in
                         sorted(roles[rank].items(), key=lambda kv: -kv[1]))
        lines.append(f"detected: rank {rank} flagged in {len(by_rank[rank])} windows ({what}): {spans}")
    late = s["detection_delay_s"] is not None and s["detection_delay_s"] > f["duration_s"] + w
    if late:
        lines.append(f"          the faulty rank was not flagged during the fault (its first flag came "
                     f"{s['detection_delay_s']:.0f} s after the start, after the fault had ended)")
    elif s["detection_delay_windows"] is not None:
        lines.append(f"          first flag on the faulty rank {s['detection_delay_windows']} window(s) after the "
                     f"fault began (an alert {s['detection_delay_s']:.1f} s after the start)")
    else:
        lines.append("          the faulty rank was never flagged during the fault")
    diag = {}
    for d in result.get("diagnoses_top", []):
        if d["rank"] in culprits:
            diag[d["kb_entry"]] = diag.get(d["kb_entry"], 0) + 1
    if diag:
        lines.append("diagnosis on the faulty rank: " + ", ".join(
            f"{k} ({n} windows)" for k, n in sorted(diag.items(), key=lambda kv: -kv[1])))
    lines.append(f"scores (strict: every flag on another rank counts against): precision {_f(s['precision'])}, recall {_f(s['recall'])}, F1 {_f(s['f1'])}, "
                 f"false-positive rate {_f(s['false_positive_rate'], 3)} "
                 f"(top KB entry {s['top_kb_entry']}, expected {s['expected_kb_entry']})")
    if result.get("plot"):
        lines.append(f"plot:     {result['plot']}")
    return "\n".join(lines)


def _role_words(role: str, culprits: list[int]) -> str:
    if role == "waiting":
        on = f" on rank {','.join(map(str, culprits))}" if culprits else ""
        return f"waiting{on}"
    return {"culprit": "culprit", "node": "node (its node's own signals)",
            "job": "job (the whole job slowed)"}.get(role, role)


def _f(v, d: int = 2) -> str:
    return "-" if v is None else f"{v:.{d}f}"


def cmd_demo(args) -> int:
    from fleetscope.cli.bench import run_in_child
    from fleetscope.cli.common import stop_on_interrupt_or_terminate
    stop_on_interrupt_or_terminate()
    scenario = Path(args.scenario) if args.scenario else demo_scenario()
    out = Path(args.out)
    print(f"fleetscope demo: scenario {scenario.name}; this takes about 3 minutes. Ctrl-C stops it cleanly.",
          flush=True)
    opts = {"out_dir": str(out), "warmup_windows": args.warmup_windows, "config": getattr(args, "config", None)}
    try:
        result = run_in_child(scenario, opts, out / "demo.log")
    except KeyboardInterrupt:
        print("demo interrupted: the fault was undone and every process stopped", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"fleetscope demo: {e}", file=sys.stderr)
        return 1
    if "skipped" in result:
        print(f"fleetscope demo: cannot run here: {result['skipped']}", file=sys.stderr)
        return 1
    print(report(result))
    return 0


def register(sub) -> None:
    d = sub.add_parser("demo", help="a few minutes of real DDP training with one injected fault, detected live")
    d.add_argument("--out", default="fleetscope-demo", help="where the result JSON and plot go (default: ./fleetscope-demo)")
    d.add_argument("--scenario", help="another scenario file instead of the built-in straggler")
    d.add_argument("--warmup-windows", type=int, default=DEMO_WARMUP_WINDOWS,
                   help=f"model warm-up windows (default {DEMO_WARMUP_WINDOWS})")
    d.set_defaults(func=cmd_demo)
