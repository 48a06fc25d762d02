"""Run fault scenarios end to end and score what fleetscope found against the truth.

For each scenario (benchmarks/scenarios/{dev,test}/*.yaml):
1. a fresh embedded stack (eval/stack.py): its own broker, data dir, topic prefix; optionally
   busy-loop processes beside everything (a loaded machine);
2. the workload as torchrun ranks under the job <scenario>-<runid> (each run is its own job);
3. wait until the job's model is warm (scores with warm=1 in the store) and the agent's tracers
   have reached every rank: the scenario's clock, t0, is the first window boundary after that,
   and at least TRACED_WINDOWS_BEFORE_CLOCK windows after the tracers reached the last rank
   (plus the repeat's start offset), so every `start_s` counts from the end of warm-up;
4. the faults' bursts and the workload events (a restart: the job comes back as
   <scenario>-<runid>-r<N>) in time order; the run ends at t0 + scenario duration_s;
5. scores, anomalies, diagnoses and features of the job(s) read back from the store, the
   ranks' step rates from their progress files (eval/impact.py), each fault's measured impact,
   scored with eval/scorer.py (strict, and lenient for comparison), plus fingerprint metrics.

Every fault is undone and every process we started is stopped, on error and on Ctrl-C too.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from fleetscope.eval.scenario import INSTANT_KINDS, FaultSpec, Scenario
from fleetscope.eval.scorer import Diagnosis, Truth, WindowResult, score_run
from fleetscope.eval.timegrid import ONSET_GRACE_WINDOWS, RECOVERY_GRACE_WINDOWS, grace, ns as _ns, window_of
from fleetscope import config as config_mod

__all__ = ["ONSET_GRACE_WINDOWS", "RECOVERY_GRACE_WINDOWS", "RunOptions", "run_scenario", "window_of"]


# Windows between the tracers reaching every rank and the scenario clock. A source that joins a rank mid-run
# (a tracer attaching late: under load the BPF compile and the ranks' torch import take 20 s and more) is judged
# by the peer detector against the rank's own usual offset from its 8th window on (peer_offset_min_obs), the
# offset being learned from those first windows: a fault starting as the source joins would be learned as the
# rank's normal (measured: a CI run whose tracers attached 1.5 s before a straggler flagged it 7 windows of 15).
TRACED_WINDOWS_BEFORE_CLOCK = 10
# Faults are built and primed this long before they start (Fault.prime: a CPU quota measures the rank's use).
PRIME_LEAD_S = 1.0


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
    seed: int = 0                       # the workload's seed (repeats differ)
    start_offset_s: float = 0.0         # extra wait between warm-up and the scenario clock (repeats differ)
    busy_loops: int = 0                 # busy-loop processes beside the run (a loaded machine)
    repeat: int = 0                     # which repeat this is; result files get a -r<N> suffix when > 0


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
        if req == "nvml_standin" and shutil.which("gcc") is None:
            raise ScenarioSkipped("gcc is needed to build the NVML stand-in (gpu_stub/fake_nvml.c)")
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
    warmup = opts.warmup_windows if opts.warmup_windows is not None else s.warmup_windows
    if warmup is not None:
        over["warmup_windows"] = warmup
    if opts.trace is not None:
        over["trace"] = tuple(opts.trace)
    over.update(opts.extra)
    return replace(base, **over).validate()


class Run:
    """One scenario's run: owns the stack, the workload and the faults until close()."""

    def __init__(self, s: Scenario, opts: RunOptions):
        self.s, self.opts = s, opts
        self.ranks = opts.ranks or s.ranks
        self.window_s = opts.window_s or s.window_s
        self.runid = uuid.uuid4().hex[:6]
        self.job = f"{s.name}-{self.runid}"
        self.jobs = [self.job]
        self._tmp = None
        base = opts.work_dir
        if base is None:
            self._tmp = tempfile.mkdtemp(prefix=f"fleetscope-eval-{s.name}-")
            base = Path(self._tmp)
        self.data_dir = Path(base) / f"{s.name}-{self.runid}"
        self.control_dir = self.data_dir / "control"
        self.progress_dir = self.data_dir / "progress"
        self.cfg = scenario_config(s, opts, self.data_dir, self.runid)
        self.stack = None
        self.workload = None
        self.active: dict[int, list] = {}        # fault index -> its running injectors
        self.primed: dict[int, list] = {}        # fault index -> injectors built and primed, not started yet
        self.injected: dict[int, list] = {}      # fault index -> [{on, off, describe}] per burst
        self.events_done: list[dict] = []
        self.workload_may_end = False            # after a crash the job ends, as torchrun ends it
        self.timeline: dict[str, float | None] = {}
        self.busy = None
        self.nvml = None                         # the NVML stand-in, for scenarios that require it
        self.log = opts.progress

    # ---- phases ---------------------------------------------------------------
    def start_busy_loops(self) -> None:
        if self.opts.busy_loops > 0:
            from fleetscope.eval.faults import HOG, _Processes
            self.busy = _Processes()
            for _ in range(self.opts.busy_loops):
                self.busy.spawn(HOG, "1")
            self.log(f"[{self.s.name}] {self.opts.busy_loops} busy-loop process(es) running beside the run")

    def start_stack(self) -> None:
        from fleetscope.eval.stack import EvalStack
        self.log(f"[{self.s.name}] starting the embedded stack in {self.data_dir}")
        if "nvml_standin" in self.s.requires:
            from fleetscope.eval.nvml_standin import NvmlStandin
            self.nvml = NvmlStandin(self.data_dir / "nvml", self.ranks).build()
            os.environ.update(self.nvml.env())   # the agent runs on a thread of this process
            self.cfg = replace(self.cfg, nvml_library=str(self.nvml.library))
            self.log(f"[{self.s.name}] NVML stand-in: {self.ranks} fake GPUs, {self.nvml.library}")
        self.stack = EvalStack(self.cfg).start()
        t = time.monotonic()
        try:
            self.stack.wait_for(self.stack.tracers_ready, 240, "the eBPF tracers")
            self.log(f"[{self.s.name}] tracers ready after {time.monotonic() - t:.0f} s")
        except RuntimeError as e:  # tracing is an add-on; the run goes on and says so
            self.stack.check()
            self.log(f"[{self.s.name}] WARNING: {e}; continuing without them")

    def ddp_args(self) -> list[str]:
        s, wa = self.s, self.s.workload_args
        args = ["--duration-s", "86400", "--seed", str(self.opts.seed)]  # stopped by us at the end
        sleep_ms = self.opts.sleep_ms or wa.get("sleep_ms")
        if sleep_ms is not None:
            args += ["--sleep-ms", str(sleep_ms)]
        for k in ("batch", "threads"):
            if k in wa:
                args += [f"--{k}", str(wa[k])]
        if "eval" in s.phases:
            args += ["--eval-every", str(s.phases["eval"]["every_steps"]),
                     "--eval-steps", str(s.phases["eval"]["steps"])]
        if "checkpoint" in s.phases:
            args += ["--ckpt-every", str(s.phases["checkpoint"]["every_steps"]),
                     "--ckpt-mb", str(s.phases["checkpoint"]["mb"])]
        if s.rank_args:
            args += ["--rank-args", json.dumps({str(r): a for r, a in s.rank_args.items()})]
        return args

    def start_workload(self) -> None:
        self.control_dir.mkdir(parents=True, exist_ok=True)
        self.progress_dir.mkdir(parents=True, exist_ok=True)
        # Identity through torchrun: the ranks get TORCHELASTIC_RUN_ID = --rdzv-id = self.job, which
        # the agent reads as their job; torchrun itself (no rank) does not carry it, so it is not
        # scored as a member of the job. FLEETSCOPE_JOB would name the launcher's job too.
        env = {"FLEETSCOPE_WORKLOAD_CONTROL_DIR": str(self.control_dir),
               "FLEETSCOPE_WORKLOAD_PROGRESS_DIR": str(self.progress_dir)}
        log = self.data_dir / "workload.log"
        if self.s.workload == "gpu_standin":
            from fleetscope.eval import standin_workload
            self.workload = standin_workload.launch(self.ranks, env, self.data_dir, self.s.workload_args,
                                                   run_id=self.job, rank_args=self.s.rank_args)
        else:
            from fleetscope.eval.workloads.launch import DEBIAN_PYTHON, launch, venv_site_packages
            python = self.opts.python or (DEBIAN_PYTHON if os.path.exists(DEBIAN_PYTHON) else None)
            self.workload = launch(self.ranks, self.ddp_args(), python=python,
                                   site_packages=venv_site_packages() if python else None,
                                   env=env, run_id=self.job, log_path=log)
        self.pids = self.workload.rank_pids(timeout_s=120)
        if self.nvml is not None:
            self.nvml.set_processes(self.pids)
        self.log(f"[{self.s.name}] workload {self.s.workload} running as job {self.job}: "
                 + ", ".join(f"rank {r} pid {p}" for r, p in sorted(self.pids.items())))

    def _check_workload(self) -> None:
        self.stack.check()
        if not self.workload_may_end and self.workload.proc.poll() is not None:
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

    def _jobs_where(self) -> tuple[str, dict]:
        params = {f"j{i}": j for i, j in enumerate(self.jobs)}
        return "(" + " OR ".join(f"job = {{j{i}:String}}" for i in range(len(self.jobs))) + ")", params

    def _status(self) -> str:
        where, p = self._jobs_where()
        res = self.stack.query(f"SELECT count(), countIf(is_anomaly = 1), max(warm) FROM scores WHERE {where}",
                               p).rows
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
        traced = self.wait_traced()
        earliest = time.time() if traced is None else max(time.time(), traced + TRACED_WINDOWS_BEFORE_CLOCK * w)
        t0 = math.ceil((earliest + self.opts.start_offset_s) / w + 1e-9) * w  # a window boundary
        self.timeline["t0"] = t0
        self.timeline["traced_before_t0_s"] = None if traced is None else round(t0 - traced, 3)
        self.log(f"[{self.s.name}] model warm; scenario clock starts at the next window boundary"
                 + (f" {TRACED_WINDOWS_BEFORE_CLOCK} windows after the tracers reached every rank"
                    if earliest > time.time() else "")
                 + (f" after a {self.opts.start_offset_s:g} s offset" if self.opts.start_offset_s else ""))
        return t0

    def wait_traced(self) -> float | None:
        """The wall time by which the agent's every tracer had tried every rank (0.0: nothing traces them); None
        when that did not happen within the budget (logged: the run goes on, and its result says so)."""
        budget = 120 + 10 * len(self.pids)
        deadline = time.monotonic() + budget
        last = time.monotonic()
        while (traced := self.stack.traced_since(list(self.pids.values()))) is None:
            self._check_workload()
            if time.monotonic() > deadline:
                self.log(f"[{self.s.name}] WARNING: the tracers had not tried every rank within {budget} s; "
                         "the clock starts anyway, and a source joining during a fault can hide it")
                return None
            if time.monotonic() - last >= 10:
                last = time.monotonic()
                self.log(f"[{self.s.name}] waiting for the tracers to reach every rank | {self._status()}")
            time.sleep(0.5)
        return traced

    def _injectors(self, f: FaultSpec) -> list:
        from fleetscope.eval.faults import NODE_WIDE_KINDS, make_fault
        relays = getattr(self.workload, "relays", None) or []   # the GPU stand-in's: one in front of each rank
        relay = getattr(self.workload, "relay", None)
        if f.target == "outside":
            return [make_fault(f.kind, strength=f.strength, params=f.params, outside=True)]
        if f.kind in NODE_WIDE_KINDS:
            return [make_fault(f.kind, strength=f.strength, params=f.params)]
        # a link fault degrades the link into its own rank (before, every rank's went to the one relay exposed,
        # rank 1's, whatever rank the scenario named)
        return [make_fault(f.kind, pid=self.pids[r], rank=r, strength=f.strength, params=f.params,
                           control_dir=self.control_dir, relay=relays[r] if r < len(relays) else relay,
                           nvml=self.nvml) for r in f.ranks]

    def fault_prime(self, i: int) -> None:
        """Build fault i's injectors PRIME_LEAD_S before it starts and prime them all at once, so what they
        measure first (a CPU quota's basis: the rank's own use) covers the same stretch on every rank."""
        self.primed[i] = self._injectors(self.s.faults[i])
        for inj in self.primed[i]:
            inj.prime()

    def fault_on(self, i: int, t0: float) -> None:
        f = self.s.faults[i]
        started = []
        try:
            for inj in self.primed.pop(i, None) or self._injectors(f):
                inj.start()
                started.append(inj)
        except BaseException:
            for inj in started:
                inj.stop()
            raise
        self.active[i] = started
        if f.kind in INSTANT_KINDS:  # a crash, or an Xid that ends the rank: the job may end with it
            self.workload_may_end = True
        self.injected.setdefault(i, []).append({"on_s": round(time.time() - t0, 3),
                                                "injectors": [inj.describe() for inj in started]})
        self.log(f"[{self.s.name}] fault {i} ON: {f.describe()}: {json.dumps(self.injected[i][-1]['injectors'])}")

    def fault_off(self, i: int, t0: float) -> None:
        for inj in self.active.pop(i, []):
            inj.stop()
        if self.injected.get(i):
            self.injected[i][-1]["off_s"] = round(time.time() - t0, 3)
        self.log(f"[{self.s.name}] fault {i} OFF")

    def restart(self, t0: float) -> None:
        """Every rank exits; the job comes back under a new run id, as torchrun restarts it.
        Faults active across the restart are stopped first and started again on the new ranks."""
        active = sorted(self.active)
        for i in active:
            for inj in self.active.pop(i):
                inj.stop()
        t = time.time()
        self.primed.clear()   # built for the old ranks' pids; fault_on builds them anew
        self.workload.stop()
        self.job = f"{self.s.name}-{self.runid}-r{len(self.jobs)}"
        self.jobs.append(self.job)
        self.start_workload()
        self.events_done.append({"kind": "restart", "at_s": round(t - t0, 3), "up_s": round(time.time() - t0, 3),
                                 "job": self.job})
        for i in active:
            self.active[i] = self._injectors(self.s.faults[i])
            for inj in self.active[i]:
                inj.start()

    def inject_and_run(self, t0: float) -> None:
        from fleetscope.eval.faults import NODE_WIDE_KINDS
        actions = []
        for i, f in enumerate(self.s.faults):
            for a, b in f.schedule.intervals():
                actions += [(a, 1, "on", i), (b, 0, "off", i)]
                if f.target != "outside" and f.kind not in NODE_WIDE_KINDS:
                    actions.append((max(0.0, a - PRIME_LEAD_S), 3, "prime", i))
        actions += [(e.at_s, 2, e.kind, None) for e in self.s.events]
        for at, _, what, i in sorted(actions):
            self._sleep_until(t0 + at, f"fault {i} {what}" if i is not None else what)
            if what == "prime":
                self.fault_prime(i)
            elif what == "on":
                self.fault_on(i, t0)
            elif what == "off":
                self.fault_off(i, t0)
            elif what == "restart":
                self.log(f"[{self.s.name}] restarting the job")
                self.restart(t0)
        self._sleep_until(t0 + self.s.duration_s, "end of run")

    def drain(self, t0: float) -> None:
        """Wait until the last window of the run is scored for every rank (or a bounded time)."""
        if self.workload_may_end and self.workload.proc.poll() is not None:
            return  # the job is gone: nothing more will be scored
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

    def _has_role(self) -> bool:
        """Whether this store's scores table has the detector's role column yet."""
        try:
            rows = self.stack.query("SELECT name FROM system.columns WHERE table = 'scores'", {}).rows
        except Exception:  # an older store without system.columns access: no role
            return False
        return any(r[0] == "role" for r in rows)

    def collect(self, t0: float) -> dict:
        q = self.stack.query
        lo, hi = _ns(t0), _ns(t0 + self.s.duration_s)
        jw, jp = self._jobs_where()
        p = {**jp, "lo": lo, "hi": hi}
        where = (f"{jw} AND toUnixTimestamp64Nano(window_start) >= {{lo:Int64}} "
                 "AND toUnixTimestamp64Nano(window_start) < {hi:Int64}")
        role = "role" if self._has_role() else "''"
        scores = q(f"SELECT rank, toUnixTimestamp64Nano(window_start), score, threshold, is_anomaly, detectors, "
                   f"{role} FROM scores FINAL WHERE {where} ORDER BY rank, window_start", p).rows
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
        return {"scores": scores, "diagnoses": diags, "anomalies": anomalies, "features": features, "node": node,
                "has_role": role == "role"}

    def close(self) -> None:
        """Undo the faults, stop the workload, the stack and the busy loops; each step runs even if one fails."""
        errors = []
        steps = [(f"fault {i}", lambda inj=inj: inj.stop()) for i, injs in self.active.items() for inj in injs]
        steps += [("workload", lambda: self.workload and self.workload.stop()),
                  ("stack", lambda: self.stack and self.stack.stop()),
                  ("busy loops", lambda: self.busy and self.busy.stop()),
                  ("NVML stand-in", lambda: self.nvml and self.nvml.release())]
        for what, fn in steps:
            try:
                fn()
            except Exception as e:  # keep cleaning up; report at the end
                errors.append(f"{what}: {e}")
        self.active.clear()
        if self._tmp and not self.opts.keep_data:
            shutil.rmtree(self._tmp, ignore_errors=True)
        if errors:
            raise RuntimeError("cleanup failed: " + "; ".join(errors))


def measure_impacts(s: Scenario, rates: dict[int, list], window_s: float, n_windows: int) -> list[dict]:
    """Each fault's impact on the step rate of the ranks it acts on (every rank for job- and
    node-wide faults), against the windows before it that no fault or event touches."""
    from fleetscope.eval.impact import fault_impact
    busy = set()
    for f in s.faults:
        for a, b in f.schedule.intervals():
            busy |= set(range(int(a // window_s), int((b // window_s)) + RECOVERY_GRACE_WINDOWS + 1))
    for e in s.events:
        k = int(e.at_s // window_s)
        busy |= set(range(k - 1, k + int(30 / window_s)))  # a restart takes up to ~30 s to step again
    out = []
    for f in s.faults:
        first = int(f.schedule.start_s // window_s)
        quiet = {k for k in range(min(first, n_windows)) if k not in busy}
        ranks = f.ranks if f.target == "ranks" else tuple(rates)
        # an instant fault (a crash) lasts a moment, its effect the rest of the run (a dead rank steps no more)
        intervals = [(f.schedule.start_s, n_windows * window_s)] if f.kind in INSTANT_KINDS else f.schedule.intervals()
        out.append(fault_impact(rates, window_s, intervals, ranks, quiet, onset_windows=ONSET_GRACE_WINDOWS))
    return out


def evaluate(s: Scenario, truth: Truth, t0: float, data: dict, detect_rule: str) -> tuple[dict, list]:
    """Score the collected rows; returns the per-scenario result body and the window results."""
    from fleetscope.eval.fingerprints import run_fingerprint_metrics
    w = truth.window_s
    results = [WindowResult(rank=r, window=window_of(ws, t0, w), flagged=bool(a), score=sc, threshold=th,
                            role=role or None)
               for r, ws, sc, th, a, _, role in data["scores"]]
    diags = [Diagnosis(rank=r, window=window_of(ws, t0, w), kb_entry=kb, confidence=c)
             for r, ws, kb, c in data["diagnoses"] if kb != "unmatched"]
    g = grace(w)
    strict = score_run(truth, results, diags, **g)
    lenient = score_run(truth, results, diags, lenient=True, **g)
    detectors: dict[str, int] = {}
    for *_, a, dets, _role in data["scores"]:
        if a:
            for d in dets:
                detectors[d] = detectors.get(d, 0) + 1
    flagged = sorted({(r, window_of(ws, t0, w), role) for r, ws, _, _, a, _, role in data["scores"] if a})
    return {"score": strict.as_dict(), "score_lenient": lenient.as_dict(),
            "roles_in_store": data.get("has_role", False),
            "rules": compare_rules(truth, data["scores"], t0, g, ran_detectors(detect_rule)),
            "fingerprint_metrics": run_fingerprint_metrics(truth, t0, data, **g),
            "flagged_windows": [{"rank": r, "window": k, "t_s": round(k * w, 3), "role": role or None}
                                for r, k, role in flagged],
            "detectors_fired": detectors,
            "diagnoses_top": _top_diagnoses(data["diagnoses"], t0, w),
            "windows_scored": len(results)}, results


# Ensemble rules compared on the same run: the scores table records every detector that
# fired in each window, whatever the rule in force, so another rule's flags can be replayed.
# (Approximate: the model skips learning from windows its own rule flagged.)
RULES = ("gmm or peer", "gmm", "peer", "hst", "mahalanobis", "gmm and mahalanobis", "2 of gmm,hst,mahalanobis",
         "2 of gmm,peer,hst,mahalanobis")


def ran_detectors(detect_rule: str) -> set[str]:
    """The detectors a worker with this rule runs (streams/scoring.py: the rule's, the primary and peers)."""
    from fleetscope.streams.model.detector_registry import ALWAYS_RUN
    from fleetscope.streams.model.ensemble import Rule
    return set(ALWAYS_RUN) | set(Rule.parse(detect_rule).names)


def compare_rules(truth: Truth, scores, t0: float, grace: dict, ran: set[str]) -> dict:
    """Each rule of RULES replayed on the run's flags; a rule needing a detector the run did not run is
    "not run" (its flags are not known, so no recall of 0 is claimed for it)."""
    from fleetscope.streams.model.ensemble import Rule
    out = {}
    for text in RULES:
        rule = Rule.parse(text)
        missing = sorted(set(rule.names) - ran)
        if missing:
            out[text] = {"not_run": f"detector(s) {', '.join(missing)} did not run in this worker"}
            continue
        res = [WindowResult(rank=r, window=window_of(ws, t0, truth.window_s), flagged=rule.decide(set(dets)),
                            role=role or None)
               for r, ws, _, _, _, dets, role in scores]
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


def result_name(s: Scenario, opts: RunOptions) -> str:
    return s.name if opts.repeat == 0 else f"{s.name}-r{opts.repeat}"


def run_scenario(s: Scenario, opts: RunOptions) -> dict:
    """Run one scenario; returns its result dict (also written to opts.out_dir/<name>[-r<N>].json)."""
    from fleetscope.eval.impact import read_progress, window_rates
    try:
        check_requirements(s)
    except ScenarioSkipped as e:
        opts.progress(f"[{s.name}] SKIPPED: {e}")
        return {"scenario": s.name, "skipped": str(e), "file": str(s.path), "repeat": opts.repeat}
    run = Run(s, opts)
    started = time.time()
    try:
        run.start_busy_loops()
        run.start_stack()
        run.start_workload()
        t0 = run.wait_warm()
        run.inject_and_run(t0)
        run.drain(t0)
        data = run.collect(t0)
        curves = read_progress(run.progress_dir)
    finally:
        run.close()
    base = replace(s.truth(), ranks=tuple(range(run.ranks)), window_s=run.window_s)
    rates = window_rates(curves, t0, run.window_s, base.n_windows)
    impacts = measure_impacts(s, rates, run.window_s, base.n_windows)
    truth = replace(s.truth({i: m["effect"] for i, m in enumerate(impacts)}),
                    ranks=tuple(range(run.ranks)), window_s=run.window_s)
    body, results = evaluate(s, truth, t0, data, run.cfg.detect_rule)
    faults = []
    for i, (f, m) in enumerate(zip(s.faults, impacts)):
        faults.append({"kind": f.kind, "target": f.target, "ranks": list(f.ranks), "strength": f.strength,
                       "params": f.params, "start_s": f.schedule.start_s, "duration_s": f.schedule.duration_s,
                       "every_s": f.schedule.every_s, "times": f.schedule.times,
                       "expect": {"kb_entry": f.expect.kb_entry, "ranks": list(f.expect.ranks),
                                  "scope": f.expect.scope, "persists": f.expect.persists},
                       "unscored": f.unscored, "impact": m,
                       "verdict": ("unscored: " + f.unscored if f.unscored else
                                   "no effect" if m["effect"] is False else
                                   "impact not measured" if m["effect"] is None else "scored"),
                       "injected": run.injected.get(i, [])})
    name = result_name(s, opts)
    out = {"scenario": s.name, "result": name, "repeat": opts.repeat, "seed": opts.seed,
           "start_offset_s": opts.start_offset_s, "busy_loops": opts.busy_loops,
           "file": str(s.path), "description": s.description.strip(), "job": run.jobs[0], "jobs": run.jobs,
           "workload": s.workload, "ranks": run.ranks, "window_s": run.window_s, "duration_s": s.duration_s,
           "warmup_windows": run.cfg.warmup_windows, "detect_rule": run.cfg.detect_rule, "t0_unix": t0,
           "traced_before_t0_s": run.timeline.get("traced_before_t0_s"),
           "data_dir": str(run.data_dir) if opts.keep_data else None,
           "trace": list(run.cfg.trace), "healthy": s.healthy, "faults": faults, "events": run.events_done,
           "impact_pct": [m["impact_pct"] for m in impacts],
           "step_rate": {str(r): [None if v is None else round(v, 2) for v in vs] for r, vs in sorted(rates.items())},
           "wall_s": round(time.time() - started, 1), **body}
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    path = opts.out_dir / f"{name}.json"
    if opts.plot:
        try:
            from fleetscope.eval.plot import plot_scores
            title = f"{s.name}: " + ("; ".join(f.describe() for f in s.faults) if s.faults else "no fault")
            out["plot"] = str(plot_scores(truth, results, opts.out_dir / f"{name}.png", title=title, rates=rates))
        except Exception as e:  # the numbers stand without the picture; say why it is missing
            out["plot_error"] = str(e)
            opts.progress(f"[{s.name}] no plot: {e}")
    path.write_text(json.dumps(out, indent=1, default=float) + "\n")
    return out
