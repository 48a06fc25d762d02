"""Load and validate fault scenario files (benchmarks/scenarios/*.yaml).

A scenario states the workload, the fault (what, which rank, when, how long, how strong)
and what the detector should find. Every error names the file and the field:
    ScenarioError: benchmarks/scenarios/x.yaml: fault.rank: 3 is not a rank of a 2-rank job
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from fleetscope.eval.faults import KNOB_KINDS
from fleetscope.eval.scorer import Truth

WORKLOADS = ("ddp_cpu", "gpu_standin")
FAULT_KINDS = ("none", "cpu_quota", "competing_load", "memory_pressure", "softirq_storm", "link_delay",
               *KNOB_KINDS)
REQUIREMENTS = ("gpu_standin", "root", "cgroup_cpu", "cgroup_memory")
KB_ENTRIES = ("gpu_power_thermal_throttling", "numa_misplacement", "irq_locality_miss", "huge_page_coverage_loss",
              "cpu_contention_noisy_neighbour", "straggler_rank", "slow_degraded_link", "h2d_copy_stall_pageable",
              "gpu_memory_leak", "dataloader_input_stall", "python_gc_storm", "xid_hardware_error")


class ScenarioError(ValueError):
    """A scenario file is invalid; the message starts with the file and the field."""


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    rank: int | None = None
    start_s: float = 0.0
    duration_s: float = 0.0
    strength: float = 1.0
    params: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Scenario:
    path: Path
    name: str
    description: str
    workload: str
    ranks: int
    duration_s: float
    window_s: float
    fault: FaultSpec
    expect_kb_entry: str | None
    expect_ranks: tuple[int, ...]
    requires: tuple[str, ...] = ()
    expect_peers: str = "ignored"      # "ignored" or "negative": how peers' windows during the fault count
    expect_persists: bool = False      # the fault's effect outlasts it on the faulty ranks (leaked memory)
    workload_args: dict = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        return self.fault.kind == "none"

    def truth(self) -> Truth:
        """The ground truth the scorer compares against."""
        if self.healthy:
            return Truth(ranks=tuple(range(self.ranks)), duration_s=self.duration_s, window_s=self.window_s)
        return Truth(ranks=tuple(range(self.ranks)), duration_s=self.duration_s, window_s=self.window_s,
                     fault_start_s=self.fault.start_s, fault_end_s=self.fault.start_s + self.fault.duration_s,
                     faulty_ranks=frozenset(self.expect_ranks), kb_entry=self.expect_kb_entry,
                     ignore_peers=self.expect_peers == "ignored", effect_persists=self.expect_persists)


class _Fields:
    """Typed access to one mapping, with errors that name file and field."""

    def __init__(self, path: Path, prefix: str, data, known: set[str]):
        self.path, self.prefix = path, prefix
        if not isinstance(data, dict):
            self.fail("", f"must be a mapping, got {type(data).__name__}")
        unknown = sorted(set(data) - known)
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


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ScenarioError(f"{path}: no such file") from None
    except yaml.YAMLError as e:
        raise ScenarioError(f"{path}: not valid YAML: {e}") from None
    top = _Fields(path, "", raw, {"name", "description", "workload", "workload_args", "ranks", "duration_s",
                                  "window_s", "fault", "expect", "requires"})
    name = top.get("name", str, check=lambda v: v.strip() != "", what="a non-empty name")
    workload = top.get("workload", str, check=lambda v: v in WORKLOADS, what=f"one of {', '.join(WORKLOADS)}")
    ranks = top.get("ranks", int, check=lambda v: 2 <= v <= 4, what="a rank count from 2 to 4")
    duration = top.get("duration_s", NUM, check=lambda v: v > 0, what="a positive number of seconds")
    window = top.get("window_s", NUM, check=lambda v: 0 < v <= duration, what="positive and at most duration_s")
    requires = top.get("requires", list, [], check=lambda v: all(r in REQUIREMENTS for r in v),
                       what=f"a list of {', '.join(REQUIREMENTS)}")
    if workload == "gpu_standin" and "gpu_standin" not in requires:
        top.fail("requires", "a gpu_standin workload must list gpu_standin")

    f = _Fields(path, "fault.", top.get("fault", dict, what="a mapping"),
                {"kind", "rank", "start_s", "duration_s", "strength", "params"})
    kind = f.get("kind", str, check=lambda v: v in FAULT_KINDS, what=f"one of {', '.join(FAULT_KINDS)}")
    if kind == "none":
        fault = FaultSpec("none", params=f.get("params", dict, {}))
    else:
        rank = f.get("rank", int, check=lambda v: 0 <= v < ranks, what=f"a rank of this {ranks}-rank job")
        start = f.get("start_s", NUM, check=lambda v: 0 <= v < duration, what="within [0, duration_s)")
        fdur = f.get("duration_s", NUM, check=lambda v: 0 < v and start + v <= duration,
                     what="positive and ending by the run's duration_s")
        strength = f.get("strength", NUM, 1.0, check=lambda v: 0 < v <= 1, what="in (0, 1]")
        fault = FaultSpec(kind, rank, float(start), float(fdur), float(strength), f.get("params", dict, {}))

    e = _Fields(path, "expect.", top.get("expect", dict, what="a mapping"), {"kb_entry", "ranks", "peers", "persists"})
    kb = e.get("kb_entry", (str, type(None)), check=lambda v: v is None or v in KB_ENTRIES,
               what="null or a KB entry (" + ", ".join(KB_ENTRIES) + ")")
    exp_ranks = e.get("ranks", list, check=lambda v: all(isinstance(r, int) and 0 <= r < ranks for r in v),
                      what=f"a list of ranks of this {ranks}-rank job")
    if kind == "none" and (kb is not None or exp_ranks):
        e.fail("kb_entry", "a healthy scenario (fault.kind none) expects kb_entry: null and ranks: []")
    if kind != "none" and (kb is None or not exp_ranks):
        e.fail("kb_entry" if kb is None else "ranks", "a fault scenario must name the KB entry and faulty ranks")
    peers = e.get("peers", str, "ignored", check=lambda v: v in ("ignored", "negative"),
                  what="ignored (the default: in a synchronous job a fault on one rank slows its peers, "
                       "so their windows during the fault are not scored) or negative")
    persists = e.get("persists", bool, False, what="true or false")
    return Scenario(path=path, name=name, description=top.get("description", str, ""), workload=workload,
                    ranks=ranks, duration_s=float(duration), window_s=float(window), fault=fault,
                    expect_kb_entry=kb, expect_ranks=tuple(exp_ranks), requires=tuple(requires),
                    expect_peers=peers, expect_persists=persists,
                    workload_args=top.get("workload_args", dict, {}))


def load_scenarios(paths) -> list[Scenario]:
    """Load every file; a directory means its *.yaml files. Names must be unique."""
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.glob("*.yaml")) if p.is_dir() else [p]
    out, seen = [], {}
    for fp in files:
        s = load_scenario(fp)
        if s.name in seen:
            raise ScenarioError(f"{fp}: name: {s.name!r} is also the name of {seen[s.name]}")
        seen[s.name] = fp
        out.append(s)
    return out
