"""Load and validate fault scenario files (benchmarks/scenarios/{dev,test}/*.yaml).

A scenario states the workload, a list of faults and workload events, and what the
detector should find for each fault. Every error names the file and the field:
    ScenarioError: benchmarks/scenarios/dev/x.yaml: faults[0].rank: 3 is not a rank of this 2-rank job

    name: two_faults
    workload: ddp_cpu            # or gpu_standin
    ranks: 3
    duration_s: 120
    window_s: 1
    warmup_windows: 15           # optional: the model's warm-up before the scenario clock starts
    requires: [gpu_standin, nvml_standin]   # what the run needs: gpu_standin (that workload), nvml_standin
                                 # (the agent samples a scripted NVML, one GPU per rank, that faults change),
                                 # root, cgroup_cpu, cgroup_memory; a run whose needs are not met is skipped
    workload_args: {sleep_ms: 20}           # every rank
    rank_args: {2: {batch: 128}}            # one rank differs by design from the start
    phases:                                 # ddp_cpu only
      eval: {every_steps: 100, steps: 20}   # a forward-only pass of 20 batches every 100 steps
      checkpoint: {every_steps: 300, mb: 32}
    events:
      - {kind: restart, at_s: 60}           # every rank exits; the job returns under a new run id
    faults:
      - kind: cpu_quota
        rank: 1                   # or ranks: [0, 2], or target: all, or target: outside
        start_s: 20
        duration_s: 10
        every_s: 30               # optional: periodic bursts ...
        times: 3                  # ... this many
        strength: 0.85
        params: {cpus: 1}
        expect: {kb_entry: straggler_rank, ranks: [1], scope: rank, persists: false}

The old single-fault form (`fault:` plus a top-level `expect:`) still loads: it becomes a
one-item `faults` list (a `kind: none` fault becomes an empty list).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from fleetscope.eval.faults import KNOB_KINDS, unscored_reason
from fleetscope.eval.scorer import FaultTruth, Truth
from fleetscope.resources import package_dir

WORKLOADS = ("ddp_cpu", "gpu_standin")
# Faults that are an event, not a state: a crash happens in one moment. Their burst is the event's own window(s),
# scored with no onset grace (the window it happens in is the one an alert belongs to), and their impact is
# measured over the rest of the run (a dead rank steps no more).
INSTANT_KINDS = frozenset(("crash", "gpu_xid"))  # a gpu_xid ends the rank after its Xid (eval/faults.py)
FAULT_KINDS = ("cpu_quota", "competing_load", "memory_pressure", "softirq_storm", "link_delay", "crash",
               "irq_affinity", "thp_off", "gpu_xid", *KNOB_KINDS)
# knobs read by only one of the two workloads
DDP_ONLY_KINDS = {"gc_storm", "dataloader_stall", "hang"}
STANDIN_ONLY_KINDS = {"memcpy_stall", "gpu_memory_leak", "gpu_throttle", "gpu_xid"}
OUTSIDE_KINDS = {"competing_load"}  # kinds that can run as a process outside the job
REQUIREMENTS = ("gpu_standin", "nvml_standin", "root", "cgroup_cpu", "cgroup_memory")
SCOPES = ("rank", "job", "node")
EVENT_KINDS = ("restart",)
# every entry the shipped KB holds (the KB loader requires each file to be named after its entry)
KB_ENTRIES = tuple(sorted(p.stem for p in package_dir("fleetscope.kb").glob("*.yaml")))
DDP_RANK_ARGS = {"batch": int, "sleep_ms": (int, float), "threads": int}
STANDIN_RANK_ARGS = {"step_sleep_ms": (int, float)}


class ScenarioError(ValueError):
    """A scenario file is invalid; the message starts with the file and the field."""


@dataclass(frozen=True)
class Schedule:
    start_s: float
    duration_s: float
    every_s: float | None = None
    times: int = 1

    def intervals(self) -> list[tuple[float, float]]:
        """Each burst as (start_s, end_s) on the scenario clock."""
        step = self.every_s or 0.0
        return [(self.start_s + i * step, self.start_s + i * step + self.duration_s) for i in range(self.times)]


@dataclass(frozen=True)
class FaultExpect:
    kb_entry: str | None
    ranks: tuple[int, ...]       # the culprits: flags there are right, flags elsewhere are false
    scope: str = "rank"          # rank | job | node
    persists: bool = False       # the effect outlasts the fault on the culprits (leaked memory, a dead rank)


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    target: str                  # "ranks" | "all" | "outside"
    ranks: tuple[int, ...]       # the ranks it acts on ("all": every rank; "outside": none)
    schedule: Schedule
    expect: FaultExpect
    strength: float = 1.0
    params: dict = field(default_factory=dict)
    unscored: str | None = None  # why this machine cannot make it real (faults.UNSCORED); never scored

    @property
    def scorable(self) -> bool:
        return self.unscored is None

    def describe(self) -> str:
        where = {"all": "every rank", "outside": "a process outside the job"}.get(
            self.target, "rank " + ",".join(map(str, self.ranks)))
        s = self.schedule
        when = f"at {s.start_s:g} s for {s.duration_s:g} s" + (f", every {s.every_s:g} s x{s.times}" if s.every_s else "")
        return f"{self.kind} on {where} {when}"


@dataclass(frozen=True)
class Event:
    kind: str
    at_s: float


@dataclass(frozen=True)
class Scenario:
    path: Path
    name: str
    description: str
    workload: str
    ranks: int
    duration_s: float
    window_s: float
    faults: tuple[FaultSpec, ...]
    events: tuple[Event, ...] = ()
    requires: tuple[str, ...] = ()
    workload_args: dict = field(default_factory=dict)
    rank_args: dict = field(default_factory=dict)      # rank -> args that differ on that rank
    phases: dict = field(default_factory=dict)         # {"eval": {...}, "checkpoint": {...}}
    warmup_windows: int | None = None                  # None: the config's

    @property
    def healthy(self) -> bool:
        return not self.faults

    def truth(self, impacts: dict[int, bool] | None = None) -> Truth:
        """The ground truth the scorer compares against. `impacts`: fault index -> whether the
        run measured an effect; a fault without one (or an unscorable kind) is not scored."""
        faults = []
        for i, f in enumerate(self.faults):
            effect = True if impacts is None or impacts.get(i) is None else impacts[i]
            faults.append(FaultTruth(intervals=tuple(f.schedule.intervals()), culprits=frozenset(f.expect.ranks),
                                     kb_entry=f.expect.kb_entry, scope=f.expect.scope,
                                     persists=f.expect.persists, scored=f.scorable and effect, name=f.describe(),
                                     instant=f.kind in INSTANT_KINDS))
        return Truth(ranks=tuple(range(self.ranks)), duration_s=self.duration_s, window_s=self.window_s,
                     faults=tuple(faults))


class _Fields:
    """Typed access to one mapping, with errors that name file and field."""

    def __init__(self, path: Path, prefix: str, data, known: set[str]):
        self.path, self.prefix = path, prefix
        if not isinstance(data, dict):
            self.fail("", f"must be a mapping, got {type(data).__name__}")
        unknown = sorted(set(map(str, data)) - known)
        if unknown:
            self.fail(unknown[0], f"unknown field (known: {', '.join(sorted(known))})")
        self.data = data

    def fail(self, name: str, msg: str):
        where = f"{self.prefix}{name}" if name else self.prefix.rstrip(".") or "(top level)"
        raise ScenarioError(f"{self.path}: {where}: {msg}")

    def get(self, name: str, types, default=..., check=None, what: str = ""):
        if name not in self.data:
            if default is ...:
                self.fail(name, "missing")
            return default
        v = self.data[name]
        wants_bool = types is bool
        if isinstance(v, bool) != wants_bool or not isinstance(v, types):  # a bool only where asked: YAML yes/no is a slip
            self.fail(name, f"must be {what or getattr(types, '__name__', types)}, got {v!r}")
        if check is not None and not check(v):
            self.fail(name, f"{v!r} is not {what}")
        return v


NUM = (int, float)


def _legacy_to_new(top: dict) -> dict:
    """The old form: one `fault` and a top-level `expect` -> a `faults` list."""
    top = dict(top)
    fault, expect = top.pop("fault"), top.pop("expect", None)
    if not isinstance(fault, dict) or fault.get("kind") == "none":
        top["faults"] = [] if isinstance(fault, dict) else fault
        return top
    fault = dict(fault)
    if isinstance(expect, dict):
        expect = {k: v for k, v in expect.items() if k != "peers"}  # peers were ignored once; strict now
    fault["expect"] = expect
    top["faults"] = [fault]
    return top


def _parse_fault(path: Path, i: int, raw, ranks: int, duration: float, workload: str) -> FaultSpec:
    f = _Fields(path, f"faults[{i}].", raw, {"kind", "rank", "ranks", "target", "start_s", "duration_s", "every_s",
                                             "times", "strength", "params", "expect"})
    kind = f.get("kind", str, check=lambda v: v in FAULT_KINDS, what=f"one of {', '.join(FAULT_KINDS)}")
    if workload == "ddp_cpu" and kind in STANDIN_ONLY_KINDS:
        f.fail("kind", f"{kind} is a knob of the GPU stand-in only; use workload: gpu_standin")
    if workload == "gpu_standin" and kind in DDP_ONLY_KINDS:
        f.fail("kind", f"{kind} is a knob of the CPU DDP workload only; use workload: ddp_cpu")
    given = [k for k in ("rank", "ranks", "target") if k in f.data]
    if len(given) != 1:
        f.fail("rank", "give exactly one target: rank: N, ranks: [..], target: all or target: outside"
               + (f" (got {', '.join(given)})" if given else ""))
    is_rank = lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < ranks  # noqa: E731
    if "rank" in f.data:
        target, on = "ranks", (f.get("rank", int, check=is_rank, what=f"a rank of this {ranks}-rank job"),)
    elif "ranks" in f.data:
        target = "ranks"
        on = tuple(f.get("ranks", list, check=lambda v: v and all(map(is_rank, v)) and len(set(v)) == len(v),
                         what=f"a non-empty list of distinct ranks of this {ranks}-rank job"))
    else:
        target = f.get("target", str, check=lambda v: v in ("all", "outside"), what="all or outside")
        on = tuple(range(ranks)) if target == "all" else ()
    if target == "outside" and kind not in OUTSIDE_KINDS:
        f.fail("target", f"{kind} cannot run outside the job; outside takes {', '.join(sorted(OUTSIDE_KINDS))}")
    if kind == "thp_off" and target != "all":
        f.fail("target", "thp_off changes the whole node: use target: all")
    start = f.get("start_s", NUM, check=lambda v: 0 <= v < duration, what="within [0, duration_s)")
    fdur = f.get("duration_s", NUM, check=lambda v: v > 0, what="a positive number of seconds")
    every = f.get("every_s", NUM, None, check=lambda v: v > fdur, what="longer than the fault's duration_s")
    times = f.get("times", int, 1, check=lambda v: v >= 1, what="a count of at least 1")
    if times > 1 and every is None:
        f.fail("every_s", "missing: times > 1 needs every_s (the period of the bursts)")
    sched = Schedule(float(start), float(fdur), float(every) if every else None, times)
    if sched.intervals()[-1][1] > duration + 1e-9:
        f.fail("duration_s", f"the last burst ends at {sched.intervals()[-1][1]:g} s, after the run's "
                             f"duration_s {duration:g}")
    strength = f.get("strength", NUM, 1.0, check=lambda v: 0 < v <= 1, what="in (0, 1]")
    params = f.get("params", dict, {})

    e = _Fields(path, f"faults[{i}].expect.", f.get("expect", dict, what="a mapping"),
                {"kb_entry", "ranks", "scope", "persists"})
    kb = e.get("kb_entry", (str, type(None)), check=lambda v: v is None or v in KB_ENTRIES,
               what="null or a KB entry (" + ", ".join(KB_ENTRIES) + ")")
    scope = e.get("scope", str, "rank" if target == "ranks" else ("node" if target == "outside" else "job"),
                  check=lambda v: v in SCOPES, what="rank, job or node")
    default_culprits = list(on) if target == "ranks" else list(range(ranks))
    culprits = e.get("ranks", list, default_culprits, check=lambda v: v and all(map(is_rank, v)),
                     what=f"a non-empty list of ranks of this {ranks}-rank job")
    persists = e.get("persists", bool, kind in INSTANT_KINDS, what="true or false")
    return FaultSpec(kind=kind, target=target, ranks=on, schedule=sched, strength=float(strength), params=params,
                     expect=FaultExpect(kb, tuple(culprits), scope, persists),
                     unscored=unscored_reason(kind, workload))


def _parse_rank_args(top: _Fields, ranks: int, workload: str) -> dict:
    raw = top.get("rank_args", dict, {})
    allowed = DDP_RANK_ARGS if workload == "ddp_cpu" else STANDIN_RANK_ARGS
    out = {}
    for r, args in raw.items():
        if not (isinstance(r, int) and 0 <= r < ranks):
            top.fail("rank_args", f"key {r!r} is not a rank of this {ranks}-rank job")
        a = _Fields(top.path, f"rank_args.{r}.", args, set(allowed))
        out[r] = {k: a.get(k, allowed[k], what=f"a number for {k}") for k in args}
    return out


def _parse_phases(top: _Fields, workload: str) -> dict:
    if "phases" not in top.data:
        return {}
    if workload != "ddp_cpu":
        top.fail("phases", "phases (evaluation passes, checkpoints) exist in the ddp_cpu workload only")
    p = _Fields(top.path, "phases.", top.get("phases", dict), {"eval", "checkpoint"})
    out = {}
    if "eval" in p.data:
        ev = _Fields(top.path, "phases.eval.", p.data["eval"], {"every_steps", "steps"})
        out["eval"] = {"every_steps": ev.get("every_steps", int, check=lambda v: v > 0, what="a positive step count"),
                       "steps": ev.get("steps", int, check=lambda v: v > 0, what="a positive batch count")}
    if "checkpoint" in p.data:
        ck = _Fields(top.path, "phases.checkpoint.", p.data["checkpoint"], {"every_steps", "mb"})
        out["checkpoint"] = {"every_steps": ck.get("every_steps", int, check=lambda v: v > 0,
                                                   what="a positive step count"),
                             "mb": ck.get("mb", NUM, check=lambda v: v > 0, what="a positive size in MB")}
    return out


def _parse_events(top: _Fields, duration: float) -> tuple[Event, ...]:
    out = []
    for i, raw in enumerate(top.get("events", list, [], what="a list")):
        e = _Fields(top.path, f"events[{i}].", raw, {"kind", "at_s"})
        kind = e.get("kind", str, check=lambda v: v in EVENT_KINDS, what=f"one of {', '.join(EVENT_KINDS)}")
        at = e.get("at_s", NUM, check=lambda v: 0 < v < duration, what="within (0, duration_s)")
        out.append(Event(kind, float(at)))
    return tuple(sorted(out, key=lambda e: e.at_s))


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ScenarioError(f"{path}: no such file") from None
    except yaml.YAMLError as e:
        raise ScenarioError(f"{path}: not valid YAML: {e}") from None
    if isinstance(raw, dict) and "fault" in raw:
        if "faults" in raw:
            raise ScenarioError(f"{path}: fault: give either fault (the old single-fault form) or faults, not both")
        raw = _legacy_to_new(raw)
    top = _Fields(path, "", raw, {"name", "description", "workload", "workload_args", "rank_args", "phases",
                                  "events", "ranks", "duration_s", "window_s", "warmup_windows", "faults",
                                  "requires"})
    name = top.get("name", str, check=lambda v: v.strip() != "", what="a non-empty name")
    workload = top.get("workload", str, check=lambda v: v in WORKLOADS, what=f"one of {', '.join(WORKLOADS)}")
    ranks = top.get("ranks", int, check=lambda v: 2 <= v <= 4, what="a rank count from 2 to 4")
    duration = top.get("duration_s", NUM, check=lambda v: v > 0, what="a positive number of seconds")
    window = top.get("window_s", NUM, check=lambda v: 0 < v <= duration, what="positive and at most duration_s")
    requires = top.get("requires", list, [], check=lambda v: all(r in REQUIREMENTS for r in v),
                       what=f"a list of {', '.join(REQUIREMENTS)}")
    if workload == "gpu_standin" and "gpu_standin" not in requires:
        top.fail("requires", "a gpu_standin workload must list gpu_standin")
    faults_raw = top.get("faults", list, what="a list of faults ([] for a healthy run)")
    faults = tuple(_parse_fault(path, i, f, ranks, float(duration), workload) for i, f in enumerate(faults_raw))
    if any(f.kind == "gpu_xid" for f in faults) and "nvml_standin" not in requires:
        top.fail("requires", "a gpu_xid fault is an Xid that NVML reports: list nvml_standin")
    return Scenario(path=path, name=name, description=top.get("description", str, ""), workload=workload,
                    ranks=ranks, duration_s=float(duration), window_s=float(window), faults=faults,
                    events=_parse_events(top, float(duration)), requires=tuple(requires),
                    workload_args=top.get("workload_args", dict, {}),
                    rank_args=_parse_rank_args(top, ranks, workload), phases=_parse_phases(top, workload),
                    warmup_windows=top.get("warmup_windows", int, None, check=lambda v: v >= 2,
                                           what="a window count of at least 2"))


def load_scenarios(paths) -> list[Scenario]:
    """Load every file; a directory means its *.yaml files (and those of its subdirectories). Names must be unique."""
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.rglob("*.yaml")) if p.is_dir() else [p]
    out, seen = [], {}
    for fp in files:
        s = load_scenario(fp)
        if s.name in seen:
            raise ScenarioError(f"{fp}: name: {s.name!r} is also the name of {seen[s.name]}")
        seen[s.name] = fp
        out.append(s)
    return out
