"""Run fault scenarios end to end and score what fleetscope found against the truth.

For each scenario (benchmarks/scenarios/*.yaml):
1. a fresh embedded stack (benchmarks/eval/stack.py): its own broker, data dir, topic prefix;
2. the workload as torchrun ranks with FLEETSCOPE_JOB=<scenario>-<runid> (each run is its own job);
3. wait until the job's model is warm (scores with warm=1 in the store): the scenario's clock,
   t0, is the first window boundary after that, so `fault.start_s` counts from the end of warm-up;
4. the fault from t0 + start_s for duration_s; the run ends at t0 + scenario duration_s;
5. scores, anomalies, diagnoses and features of the job read back from the store, scored
   with benchmarks/eval/scorer.py, plus the fingerprint metrics of streams/diagnosis/metrics.py.

Every fault is undone and every process we started is stopped, on error and on Ctrl-C too.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from fleetscope.eval.scenario import Scenario
from fleetscope.eval.scorer import Diagnosis, Truth, WindowResult, score_run
from fleetscope import config as config_mod

# Scoring grace: the window holding the fault's start may or may not see it (it can
# start mid-window), and the effect outlives the fault by a window while queues drain.
ONSET_GRACE_WINDOWS = 1
RECOVERY_GRACE_WINDOWS = 2


class ScenarioSkipped(RuntimeError):
    """This machine cannot run the scenario; the message says what is missing."""


@dataclass
class RunOptions:
    out_dir: Path = Path("benchmarks/results/scenarios")
    ranks: int | None = None            # override the scenario's rank count
    window_s: float | None = None       # override the scenario's window
    warmup_windows: int | None = None   # None: the config's (default 30)
    trace: tuple[str, ...] | None = None  # probe families; None: the config's (all)
    python: str | None = None           # rank interpreter; None: Debian's python3.11 if present (USDT)
    sleep_ms: float | None = None       # workload's per-step sleep; None: its default
    work_dir: Path | None = None        # data dirs go here; None: a temp dir, removed after
    keep_data: bool = False
    plot: bool = True
    progress: Callable[[str], None] = print
    base_config: config_mod.Config | None = None
    extra: dict = field(default_factory=dict)  # more Config overrides


def check_requirements(s: Scenario) -> None:
    from fleetscope.eval.cgroups import CgroupUnavailable, controller_root, memory_charges_move
    for req in s.requires:
        if req == "root" and os.geteuid() != 0:
            raise ScenarioSkipped("needs root (cgroups, pinning, eBPF)")
        if req in ("cgroup_cpu", "cgroup_memory"):
            try:
                controller_root(req.split("_", 1)[1])
            except CgroupUnavailable as e:
                raise ScenarioSkipped(str(e)) from None
            if req == "cgroup_memory":
                why = memory_charges_move()
                if why:
                    raise ScenarioSkipped(f"{why}, so a memory limit would not reach the rank's pages "
                                          "and the fault would do nothing")
        if req == "gpu_standin":
            from fleetscope.eval import standin_workload
            why = standin_workload.unavailable()
            if why:
                raise ScenarioSkipped(why)


def scenario_config(s: Scenario, opts: RunOptions, data_dir: Path, runid: str) -> config_mod.Config:
    base = opts.base_config or config_mod.load(env={})
    window_s = opts.window_s or s.window_s
    over = dict(data_dir=data_dir, topic_prefix=f"eval-{runid}", window_s=window_s,
                consumer_group=f"eval-{runid}",
                sample_interval_s=max(0.1, min(base.sample_interval_s, window_s / 2)),
                # lateness and the step hold scale with the window: events reach the
                # worker within about a sample interval, and a short run cannot wait long
                allowed_lateness_s=min(base.allowed_lateness_s, window_s),
                step_hold_s=min(base.step_hold_s, 1.5 * window_s),
                idle_close_s=max(2 * window_s, 2.0))
    if opts.warmup_windows is not None:
        over["warmup_windows"] = opts.warmup_windows
    if opts.trace is not None:
        over["trace"] = tuple(opts.trace)
    over.update(opts.extra)
    return replace(base, **over).validate()


def _ns(t: float) -> int:
    return int(round(t * 1e9))


class Run:
    """One scenario's run: owns the stack, the workload and the fault until close()."""

    def __init__(self, s: Scenario, opts: RunOptions):
        self.s, self.opts = s, opts
        self.ranks = opts.ranks or s.ranks
        self.window_s = opts.window_s or s.window_s
        self.runid = uuid.uuid4().hex[:6]
        self.job = f"{s.name}-{self.runid}"
        self._tmp = None
        base = opts.work_dir
        if base is None:
            self._tmp = tempfile.mkdtemp(prefix=f"fleetscope-eval-{s.name}-")
            base = Path(self._tmp)
        self.data_dir = Path(base) / f"{s.name}-{self.runid}"
        self.control_dir = self.data_dir / "control"
        self.cfg = scenario_config(s, opts, self.data_dir, self.runid)
        self.stack = None
        self.workload = None
        self.fault = None
        self.timeline: dict[str, float] = {}
        self.log = opts.progress

    # ---- phases ---------------------------------------------------------------
    def start_stack(self) -> None:
        from fleetscope.eval.stack import EvalStack
        self.log(f"[{self.s.name}] starting the embedded stack in {self.data_dir}")
        self.stack = EvalStack(self.cfg).start()
        t = time.monotonic()
        try:
            self.stack.wait_for(self.stack.tracers_ready, 240, "the eBPF tracers")
            self.log(f"[{self.s.name}] tracers ready after {time.monotonic() - t:.0f} s")
        except RuntimeError as e:  # tracing is an add-on; the run goes on and says so
            self.stack.check()
            self.log(f"[{self.s.name}] WARNING: {e}; continuing without them")

    def start_workload(self) -> None:
        self.control_dir.mkdir(parents=True, exist_ok=True)
        # Identity through torchrun: the ranks get TORCHELASTIC_RUN_ID = --rdzv-id = self.job, which
        # the agent reads as their job; torchrun itself (no rank) does not carry it, so it is not
        # scored as a member of the job. FLEETSCOPE_JOB would name the launcher's job too.
        env = {"FLEETSCOPE_WORKLOAD_CONTROL_DIR": str(self.control_dir)}
        if self.s.workload == "gpu_standin":
            from fleetscope.eval import standin_workload
            self.workload = standin_workload.launch(self.ranks, env, self.data_dir, self.s.workload_args,
                                                   run_id=self.job)
        else:
            from fleetscope.eval.workloads.launch import DEBIAN_PYTHON, launch, venv_site_packages
            python = self.opts.python or (DEBIAN_PYTHON if os.path.exists(DEBIAN_PYTHON) else None)
            args = ["--duration-s", "86400"]  # stopped by us at the end
            sleep_ms = self.opts.sleep_ms or self.s.workload_args.get("sleep_ms")
            if sleep_ms is not None:
                args += ["--sleep-ms", str(sleep_ms)]
            self.workload = launch(self.ranks, args, python=python,
                                   site_packages=venv_site_packages() if python else None,
                                   env=env, run_id=self.job, log_path=self.data_dir / "workload.log")
        self.pids = self.workload.rank_pids(timeout_s=120)
        self.log(f"[{self.s.name}] workload {self.s.workload} running as job {self.job}: "
                 + ", ".join(f"rank {r} pid {p}" for r, p in sorted(self.pids.items())))

    def _check_workload(self) -> None:
        self.stack.check()
        if self.workload.proc.poll() is not None:
            raise RuntimeError(f"the workload exited early with code {self.workload.proc.returncode}; "
                               f"see {self.workload.log_path}")

    def _sleep_until(self, wall_s: float, what: str, every_s: float = 10.0) -> None:
        last = 0.0
        while (left := wall_s - time.time()) > 0:
            self._check_workload()
            if time.monotonic() - last >= every_s:
                last = time.monotonic()
                self.log(f"[{self.s.name}] {what} in {left:.0f} s | {self._status()}")
            time.sleep(min(0.5, left))

    def _status(self) -> str:
        res = self.stack.query("SELECT count(), countIf(is_anomaly = 1), max(warm) FROM scores "
                               "WHERE job = {j:String}", {"j": self.job}).rows
        n, flagged, warm = res[0] if res else (0, 0, 0)
        return f"{n} rank-windows scored, {flagged} flagged, {'warm' if warm else 'warming up'}"

    def wait_warm(self) -> float:
        c = self.cfg
        budget = (c.warmup_windows + 4) * c.window_s * 3 + 120
        self.log(f"[{self.s.name}] warming up the job's model: {c.warmup_windows} windows of {c.window_s} s")
        deadline = time.monotonic() + budget
        last = 0.0
        while True:
            self._check_workload()
            rows = self.stack.query("SELECT countIf(warm = 1) FROM scores WHERE job = {j:String}",
                                    {"j": self.job}).rows
            if rows and rows[0][0] > 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the job's model did not finish warm-up within {budget:.0f} s "
                                   f"({self._status()}); see {self.data_dir}/streams.log")
            if time.monotonic() - last >= 10:
                last = time.monotonic()
                self.log(f"[{self.s.name}] warm-up: {self._status()}")
            time.sleep(1.0)
        w = c.window_s
        t0 = math.ceil(time.time() / w + 1e-9) * w  # the next window boundary in event time
        self.timeline["t0"] = t0
        self.log(f"[{self.s.name}] model warm; scenario clock starts at the next window boundary")
        return t0

    def inject_and_run(self, t0: float) -> None:
        from fleetscope.eval.faults import make_fault
        s, f = self.s, self.s.fault
        if not s.healthy:
            self._sleep_until(t0 + f.start_s, f"fault {f.kind} on rank {f.rank}")
            relay = getattr(self.workload, "relay", None)
            self.fault = make_fault(f.kind, pid=self.pids[f.rank], rank=f.rank, strength=f.strength,
                                    params=f.params, control_dir=self.control_dir, relay=relay)
            self.fault.start()
            self.timeline["fault_on"] = time.time()
            self.log(f"[{s.name}] fault ON: {json.dumps(self.fault.describe())}")
            self._sleep_until(t0 + f.start_s + f.duration_s, "fault off")
            self.fault.stop()
            self.timeline["fault_off"] = time.time()
            self.log(f"[{s.name}] fault OFF")
        self._sleep_until(t0 + s.duration_s, "end of run")

    def drain(self, t0: float) -> None:
        """Wait until the last window of the run is scored for every rank (or a bounded time)."""
        last_start = _ns(t0 + self.s.duration_s - self.window_s)
        budget = self.cfg.allowed_lateness_s + self.cfg.step_hold_s + 4 * self.window_s + 30
        deadline = time.monotonic() + budget
        while time.monotonic() < deadline:
            self.stack.check()
            n = self.stack.query("SELECT uniqExact(rank) FROM scores WHERE job = {j:String} "
                                 "AND toUnixTimestamp64Nano(window_start) >= {s:Int64}",
                                 {"j": self.job, "s": last_start}).rows[0][0]
            if n >= self.ranks:
                return
            time.sleep(0.5)
        self.log(f"[{self.s.name}] WARNING: the run's last window was not scored for every rank "
                 f"within {budget:.0f} s; missing windows are counted as not flagged")

    def collect(self, t0: float) -> dict:
        q = self.stack.query
        lo, hi = _ns(t0), _ns(t0 + self.s.duration_s)
        p = {"j": self.job, "lo": lo, "hi": hi}
        where = ("job = {j:String} AND toUnixTimestamp64Nano(window_start) >= {lo:Int64} "
                 "AND toUnixTimestamp64Nano(window_start) < {hi:Int64}")
        scores = q(f"SELECT rank, toUnixTimestamp64Nano(window_start), score, threshold, is_anomaly, detectors "
                   f"FROM scores FINAL WHERE {where} ORDER BY rank, window_start", p).rows
        diags = q(f"SELECT rank, toUnixTimestamp64Nano(window_start), kb_entry, confidence FROM diagnoses FINAL "
                  f"WHERE {where}", p).rows
        anomalies = q(f"SELECT rank, toUnixTimestamp64Nano(window_start), host, score, threshold, detectors, "
                      f"contributions, peer_z, feature FROM anomalies FINAL WHERE {where}", p).rows
        features = q(f"SELECT rank, toUnixTimestamp64Nano(window_start), host, feature FROM features FINAL "
                     f"WHERE {where}", p).rows
        node = []
        for host in sorted({h for _, _, h, _ in features}):  # node rows: tenant '_node', job = host
            node += q("SELECT job, toUnixTimestamp64Nano(window_start), feature FROM features FINAL "
                      "WHERE tenant = '_node' AND job = {h:String} "
                      "AND toUnixTimestamp64Nano(window_start) >= {lo:Int64} "
                      "AND toUnixTimestamp64Nano(window_start) < {hi:Int64}", {"h": host, "lo": lo, "hi": hi}).rows
        return {"scores": scores, "diagnoses": diags, "anomalies": anomalies, "features": features, "node": node}

    def close(self) -> None:
        """Undo the fault, stop the workload and the stack; each step runs even if one fails."""
        errors = []
        for what, fn in (("fault", lambda: self.fault and self.fault.stop()),
                         ("workload", lambda: self.workload and self.workload.stop()),
                         ("stack", lambda: self.stack and self.stack.stop())):
            try:
                fn()
            except Exception as e:  # keep cleaning up; report at the end
                errors.append(f"{what}: {e}")
        if self._tmp and not self.opts.keep_data:
            import shutil
            shutil.rmtree(self._tmp, ignore_errors=True)
        if errors:
            raise RuntimeError("cleanup failed: " + "; ".join(errors))


def window_of(ns: int, t0: float, window_s: float) -> int:
    return int(round((ns - _ns(t0)) / _ns(window_s)))


def evaluate(s: Scenario, truth: Truth, t0: float, data: dict) -> dict:
    """Score the collected rows; returns the per-scenario result body."""
    from fleetscope.eval.fingerprints import run_fingerprint_metrics
    w = truth.window_s
    results = [WindowResult(rank=r, window=window_of(ws, t0, w), flagged=bool(a), score=sc, threshold=th)
               for r, ws, sc, th, a, _ in data["scores"]]
    diags = [Diagnosis(rank=r, window=window_of(ws, t0, w), kb_entry=kb, confidence=c)
             for r, ws, kb, c in data["diagnoses"] if kb != "unmatched"]
    grace = dict(onset_grace_s=ONSET_GRACE_WINDOWS * w, recovery_grace_s=RECOVERY_GRACE_WINDOWS * w)
    score = score_run(truth, results, diags, **grace)
    # every peer window and every window after the fault scored as negative, whatever the scenario says
    strict = score_run(replace(truth, ignore_peers=False, effect_persists=False), results, diags, **grace)
    detectors: dict[str, int] = {}
    for *_, a, dets in data["scores"]:
        if a:
            for d in dets:
                detectors[d] = detectors.get(d, 0) + 1
    flagged = sorted({(r, window_of(ws, t0, w)) for r, ws, _, _, a, _ in data["scores"] if a})
    return {"score": score.as_dict(), "score_strict": strict.as_dict(),
            "rules": compare_rules(truth, data["scores"], t0, grace),
            "fingerprint_metrics": run_fingerprint_metrics(truth, t0, data, **grace),
            "flagged_windows": [{"rank": r, "window": k, "t_s": round(k * w, 3)} for r, k in flagged],
            "detectors_fired": detectors,
            "diagnoses_top": _top_diagnoses(data["diagnoses"], t0, w),
            "windows_scored": len(results)}, results


# Ensemble rules compared on the same run: the scores table records every detector that
# fired in each window, whatever the rule in force, so another rule's flags can be replayed.
# (Approximate: the model skips learning from windows its own rule flagged.)
RULES = ("gmm or peer", "gmm", "peer", "hst", "mahalanobis", "gmm and mahalanobis", "2 of gmm,hst,mahalanobis",
         "2 of gmm,peer,hst,mahalanobis")


def compare_rules(truth: Truth, scores, t0: float, grace: dict) -> dict:
    from fleetscope.streams.model.ensemble import Rule
    out = {}
    for text in RULES:
        rule = Rule.parse(text)
        res = [WindowResult(rank=r, window=window_of(ws, t0, truth.window_s), flagged=rule.decide(set(dets)))
               for r, ws, _, _, _, dets in scores]
        sc = score_run(truth, res, **grace)
        out[text] = {k: getattr(sc, k) for k in ("tp", "fp", "fn", "precision", "recall", "f1",
                                                 "false_positive_rate", "detection_delay_windows")}
    return out


def _top_diagnoses(rows, t0: float, w: float) -> list[dict]:
    best: dict[tuple[int, int], tuple] = {}
    for r, ws, kb, c in rows:
        k = (r, window_of(ws, t0, w))
        if k not in best or c > best[k][1]:
            best[k] = (kb, c)
    return [{"rank": r, "window": k, "kb_entry": kb, "confidence": round(float(c), 3)}
            for (r, k), (kb, c) in sorted(best.items())]


def run_scenario(s: Scenario, opts: RunOptions) -> dict:
    """Run one scenario; returns its result dict (also written to opts.out_dir/<name>.json)."""
    try:
        check_requirements(s)
    except ScenarioSkipped as e:
        opts.progress(f"[{s.name}] SKIPPED: {e}")
        return {"scenario": s.name, "skipped": str(e), "file": str(s.path)}
    run = Run(s, opts)
    started = time.time()
    try:
        run.start_stack()
        run.start_workload()
        t0 = run.wait_warm()
        run.inject_and_run(t0)
        run.drain(t0)
        data = run.collect(t0)
    finally:
        run.close()
    truth = replace(s.truth(), ranks=tuple(range(run.ranks)), window_s=run.window_s)
    body, results = evaluate(s, truth, t0, data)
    out = {"scenario": s.name, "file": str(s.path), "description": s.description.strip(), "job": run.job,
           "workload": s.workload, "ranks": run.ranks, "window_s": run.window_s, "duration_s": s.duration_s,
           "warmup_windows": run.cfg.warmup_windows, "detect_rule": run.cfg.detect_rule, "t0_unix": t0,
           "data_dir": str(run.data_dir) if opts.keep_data else None,
           "trace": list(run.cfg.trace),
           "fault": {"kind": s.fault.kind, "rank": s.fault.rank, "start_s": s.fault.start_s,
                     "duration_s": s.fault.duration_s, "strength": s.fault.strength, "params": s.fault.params,
                     "injected": (None if s.healthy else
                                  {k: round(v - t0, 3) for k, v in run.timeline.items() if k != "t0"})},
           "expect": {"kb_entry": s.expect_kb_entry, "ranks": list(s.expect_ranks)},
           "wall_s": round(time.time() - started, 1), **body}
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    (opts.out_dir / f"{s.name}.json").write_text(json.dumps(out, indent=1, default=float) + "\n")
    if opts.plot:
        try:
            from fleetscope.eval.plot import plot_scores
            out["plot"] = str(plot_scores(truth, results, opts.out_dir / f"{s.name}.png",
                                          title=f"{s.name}: {s.fault.kind} on rank {s.fault.rank}"
                                          if not s.healthy else f"{s.name}: no fault"))
        except Exception as e:  # the numbers stand without the picture; say why it is missing
            out["plot_error"] = str(e)
            opts.progress(f"[{s.name}] no plot: {e}")
    (opts.out_dir / f"{s.name}.json").write_text(json.dumps(out, indent=1, default=float) + "\n")
    return out
