"""`fleetscope energy diff --job A --job B`: where job B spends more GPU energy than job A, per unit of work.

Differential energy debugging (Magneton): the same work done twice, under two
configurations, should cost the same energy operator by operator; the
operators whose energy per unit of work grew are where B wastes it. Reads
`operator_energy` (energy per job, rank, operator and window; how it is
estimated, and what that misses: streams/energy_features.py and the README)
and `features`/`raw_metrics` for what the store knows of each job's set-up.

Work done: the store has no step counter of the workload's own, so a step is
one NCCL collective call per rank (`--per step`; under DDP a step makes a
fixed number of bucketed all-reduces, so this is steps times a constant as
long as both runs bucket alike); `--per op` counts torch op calls (or CUDA
kernel launches). `--per token` and `--per sample` are a step divided by the
tokens or samples each step processes, which only the user knows
(`--step-size`).
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field

from fleetscope.cli.common import load_config, open_configured_store

UNITS = ("step", "op", "token", "sample")
# rank features whose job means describe a run's set-up; shown when the two jobs differ by more than SETTING_REL
SETTINGS = ("nccl_bytes_per_s", "nccl_calls_per_s", "cuda_launch_per_s", "torch_ops_per_s", "torch_matmul_ops_per_s",
            "cuda_memcpy_htod_bytes_per_s", "cuda_mem_live_bytes", "cuda_pinned_live_bytes", "gpu_proc_mem_bytes",
            "gpu_proc_sm_util", "python_gc_per_s", "proc_threads")
PER_COLLECTIVE = {"nccl_bytes_per_s": "nccl bytes per collective", "cuda_launch_per_s": "kernel launches per collective",
                  "torch_ops_per_s": "torch ops per collective", "torch_matmul_ops_per_s": "matmul ops per collective",
                  "cuda_memcpy_htod_bytes_per_s": "HtoD bytes per collective"}
SETTING_REL = 0.10


class EnergyDiffError(ValueError):
    """The store cannot answer the comparison; the message says what to do."""


@dataclass
class JobEnergy:
    tenant: str
    job: str
    basis: str
    energy_j: dict[str, float]       # operator -> joules
    busy_ns: dict[str, float]        # operator -> weight (op time, or launch time)
    collectives: float               # summed over ranks and windows
    ops: float
    ranks: int
    windows: int

    def steps(self) -> float:
        return self.collectives / self.ranks if self.ranks else 0.0


@dataclass
class OperatorDiff:
    operator: str
    a: float        # joules per unit of work, job A
    b: float
    busy_a: float   # busy ns per unit of work
    busy_b: float

    @property
    def excess(self) -> float:
        return self.b - self.a


@dataclass
class EnergyDiff:
    a: JobEnergy
    b: JobEnergy
    per: str
    work_unit: str                     # what a unit of work was counted as
    work_a: float
    work_b: float
    operators: list[OperatorDiff]      # by excess, largest first
    settings: list[tuple[str, str, str]] = field(default_factory=list)  # (what, A, B) that differ

    @property
    def total_a(self) -> float:
        return sum(self.a.energy_j.values()) / self.work_a

    @property
    def total_b(self) -> float:
        return sum(self.b.energy_j.values()) / self.work_b


def split_job(text: str, tenant: str | None) -> tuple[str | None, str]:
    """"tenant/job" or "job" (with --tenant, or any tenant that has it)."""
    if "/" in text:
        t, _, j = text.partition("/")
        return t, j
    return tenant, text


def _resolve_tenant(store, tenant: str | None, job: str) -> str:
    rows = store.query("SELECT DISTINCT tenant FROM operator_energy WHERE job = {j:String}", {"j": job}).rows
    tenants = sorted(r[0] for r in rows)
    if tenant is not None:
        if tenant not in tenants:
            raise EnergyDiffError(f"no energy per operator stored for job {tenant}/{job}")
        return tenant
    if not tenants:
        raise EnergyDiffError(f"no energy per operator stored for job {job!r}: it needs the nvml source "
                               "(GPU energy) and the torch or cuda tracer on its ranks")
    if len(tenants) > 1:
        raise EnergyDiffError(f"job {job!r} exists under tenants {', '.join(tenants)}; name one as TENANT/{job}")
    return tenants[0]


def _bases(store, tenant: str, job: str) -> set[str]:
    rows = store.query("SELECT DISTINCT basis FROM operator_energy WHERE tenant = {t:String} AND job = {j:String}",
                       {"t": tenant, "j": job}).rows
    return {r[0] for r in rows}


def choose_basis(store, a: tuple[str, str], b: tuple[str, str], basis: str) -> str:
    both = _bases(store, *a) & _bases(store, *b)
    if basis != "auto":
        if basis not in both:
            raise EnergyDiffError(f"basis {basis!r} is not stored for both jobs (they share: "
                                  f"{', '.join(sorted(both)) or 'none'}); pick one of those or --basis auto")
        return basis
    for preferred in ("torch", "cuda"):
        if preferred in both:
            return preferred
    raise EnergyDiffError("the two jobs share no basis of energy per operator (one has torch ops, the other only "
                          "CUDA kernels?); trace the same sources on both")


def load_job(store, tenant: str, job: str, basis: str) -> JobEnergy:
    params = {"t": tenant, "j": job, "b": basis}
    per_op = store.query(
        "SELECT operator, sum(energy_j), sum(busy_ns) FROM operator_energy FINAL "
        "WHERE tenant = {t:String} AND job = {j:String} AND basis = {b:String} GROUP BY operator", params).rows
    work = store.query(
        "SELECT sum(c), sum(o), uniqExact(rank), uniqExact(window_start) FROM ("
        " SELECT rank, host, window_start, any(collectives) AS c, any(ops) AS o FROM operator_energy FINAL"
        " WHERE tenant = {t:String} AND job = {j:String} AND basis = {b:String}"
        " GROUP BY rank, host, window_start)", params).rows
    collectives, ops, ranks, windows = work[0]
    return JobEnergy(tenant, job, basis, {r[0]: float(r[1]) for r in per_op}, {r[0]: float(r[2]) for r in per_op},
                     float(collectives or 0), float(ops or 0), int(ranks or 0), int(windows or 0))


def work_done(a: JobEnergy, b: JobEnergy, per: str, step_size: tuple[float, float] | None) -> tuple[str, float, float]:
    """(what a unit was counted as, units of A, units of B)."""
    if per == "op":
        if not (a.ops and b.ops):
            raise EnergyDiffError("--per op: a job has no torch op or kernel launch counts")
        what = "torch op calls" if a.basis == "torch" else "kernel launches (or torch op calls)"
        return what, a.ops, b.ops
    if not (a.steps() and b.steps()):
        raise EnergyDiffError(f"--per {per}: a job has no NCCL collective calls to count steps by (is the nccl "
                              "tracer on?); compare --per op instead")
    if per == "step":
        return "steps, counted as NCCL collective calls per rank", a.steps(), b.steps()
    if step_size is None:
        raise EnergyDiffError(f"--per {per}: the store does not know how many {per}s a step processes; give "
                              f"--step-size N (both jobs) or --step-size N_A --step-size N_B")
    return (f"{per}s: steps (NCCL collective calls per rank) x --step-size {step_size[0]:g}/{step_size[1]:g}",
            a.steps() * step_size[0], b.steps() * step_size[1])


def diff_operators(a: JobEnergy, b: JobEnergy, work_a: float, work_b: float) -> list[OperatorDiff]:
    names = set(a.energy_j) | set(b.energy_j)
    out = [OperatorDiff(op, a.energy_j.get(op, 0.0) / work_a, b.energy_j.get(op, 0.0) / work_b,
                        a.busy_ns.get(op, 0.0) / work_a, b.busy_ns.get(op, 0.0) / work_b) for op in names]
    return sorted(out, key=lambda d: (-d.excess, d.operator))


def job_settings(store, tenant: str, job: str) -> dict[str, float]:
    """What the store shows of a job's set-up: ranks, hosts, GPUs and sources (identity), and per-collective
    ratios and means of its rank features."""
    p = {"t": tenant, "j": job}
    out: dict[str, float] = {}
    ident = store.query("SELECT uniqExact(rank), uniqExact(host), count() FROM features FINAL "
                        "WHERE tenant = {t:String} AND job = {j:String}", p).rows[0]
    out["ranks"], out["hosts"], out["windows"] = float(ident[0]), float(ident[1]), float(ident[2])
    gpus = store.query("SELECT uniqExact(host, gpu) FROM raw_metrics WHERE tenant = {t:String} AND job = {j:String} "
                       "AND gpu >= 0", p).rows
    out["GPUs"] = float(gpus[0][0]) if gpus else 0.0
    means = store.query(
        "SELECT k, avg(v), sum(v) FROM (SELECT arrayJoin(mapKeys(feature)) AS k, feature[k] AS v FROM features FINAL "
        "WHERE tenant = {t:String} AND job = {j:String}) GROUP BY k", p).rows
    mean = {k: float(v) for k, v, _ in means}
    total = {k: float(v) for k, _, v in means}
    for name in SETTINGS:
        if name in mean:
            out[name] = mean[name]
    # Per collective: the ratio of totals over the job's windows (every window spans window_s, so a rate summed
    # is a count), not of means: a means ratio divides by a mean over a different set of windows whenever a
    # window has one feature and not the other (a partial first or last window with a collective and no launch)
    calls = total.get("nccl_calls_per_s")
    for name, label in PER_COLLECTIVE.items():
        if calls and name in total:
            out[label] = total[name] / calls
    sources = store.query("SELECT groupUniqArrayArray(sources) FROM features FINAL "
                          "WHERE tenant = {t:String} AND job = {j:String}", p).rows
    out["sources: " + ",".join(sorted(sources[0][0] if sources else []))] = 1.0
    return out


def setting_differences(a: dict[str, float], b: dict[str, float]) -> list[tuple[str, str, str]]:
    out = []
    for name in sorted(set(a) | set(b)):
        va, vb = a.get(name), b.get(name)
        if name.startswith("sources: "):
            continue
        if va is None or vb is None:
            out.append((name, _num(va), _num(vb)))
        elif abs(vb - va) > SETTING_REL * max(abs(va), abs(vb), 1e-12):
            out.append((name, _num(va), _num(vb)))
    src_a = next((n[9:] for n in a if n.startswith("sources: ")), "")
    src_b = next((n[9:] for n in b if n.startswith("sources: ")), "")
    if src_a != src_b:
        out.append(("sources", src_a or "-", src_b or "-"))
    return out


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}"


def energy_diff(store, job_a: str, job_b: str, per: str = "step", basis: str = "auto", tenant: str | None = None,
                step_size: tuple[float, float] | None = None) -> EnergyDiff:
    ta, ja = split_job(job_a, tenant)
    tb, jb = split_job(job_b, tenant)
    a_key = (_resolve_tenant(store, ta, ja), ja)
    b_key = (_resolve_tenant(store, tb, jb), jb)
    chosen = choose_basis(store, a_key, b_key, basis)
    a, b = load_job(store, *a_key, chosen), load_job(store, *b_key, chosen)
    what, work_a, work_b = work_done(a, b, per, step_size)
    return EnergyDiff(a, b, per, what, work_a, work_b, diff_operators(a, b, work_a, work_b),
                      setting_differences(job_settings(store, *a_key), job_settings(store, *b_key)))


def format_diff(d: EnergyDiff, top: int = 10) -> str:
    unit = d.per
    lines = [f"energy per {unit}: A {d.a.tenant}/{d.a.job} {d.total_a:.4g} J, B {d.b.tenant}/{d.b.job} "
             f"{d.total_b:.4g} J ({_pct(d.total_b, d.total_a)}); basis {d.a.basis}",
             f"work: {d.work_unit}: A {d.work_a:.6g}, B {d.work_b:.6g} "
             f"({d.a.ranks} and {d.b.ranks} ranks, {d.a.windows} and {d.b.windows} windows)",
             "",
             f"operators by excess energy per {unit} (B - A):",
             f"  {'operator':<48} {'A J':>10} {'B J':>10} {'excess J':>10} {'A busy ms':>10} {'B busy ms':>10}"]
    for o in d.operators[:top]:
        lines.append(f"  {o.operator[:48]:<48} {o.a:>10.4g} {o.b:>10.4g} {o.excess:>+10.4g} "
                     f"{o.busy_a / 1e6:>10.4g} {o.busy_b / 1e6:>10.4g}")
    lines.append("")
    if d.settings:
        lines.append("set-up differences the store shows (A -> B):")
        lines += [f"  {name}: {va} -> {vb}" for name, va, vb in d.settings]
    else:
        lines.append("set-up differences the store shows: none beyond 10% (identity, sources, per-collective ratios)")
    return "\n".join(lines)


def _pct(b: float, a: float) -> str:
    if not a or not math.isfinite(a):
        return "n/a"
    return f"{100 * (b - a) / a:+.1f}%"


def register(subparsers) -> None:
    p = subparsers.add_parser("energy", help="GPU energy per operator: compare two jobs (differential energy)")
    sub = p.add_subparsers(dest="energy_command", required=True)
    diff = sub.add_parser("diff", help="rank operators by the energy per unit of work job B spends over job A")
    diff.add_argument("--job", action="append", required=True, metavar="[TENANT/]JOB",
                      help="a job to compare; give it twice: the baseline A, then B")
    diff.add_argument("--per", choices=UNITS, default="step",
                      help="unit of work: step (NCCL collective calls per rank), op (torch op calls or kernel "
                           "launches), token or sample (a step / --step-size)")
    diff.add_argument("--step-size", type=float, action="append", default=[], metavar="N",
                      help="tokens or samples per step, for --per token|sample: once for both jobs, or A then B")
    diff.add_argument("--basis", choices=("auto", "torch", "cuda"), default="auto",
                      help="operators as torch ops or CUDA kernel names (auto: torch where both jobs have it)")
    diff.add_argument("--tenant", help="the jobs' tenant, when a job name exists under several")
    diff.add_argument("--top", type=int, default=10, help="operators to show (default 10)")
    diff.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if len(args.job) != 2:
        print("fleetscope energy diff: give --job exactly twice (A, the baseline, then B)", file=sys.stderr)
        return 2
    sizes = args.step_size
    if len(sizes) > 2 or any(s <= 0 for s in sizes):
        print("fleetscope energy diff: --step-size takes one or two positive numbers", file=sys.stderr)
        return 2
    step_size = None if not sizes else (sizes[0], sizes[-1])
    store = open_configured_store(load_config(args))
    try:
        d = energy_diff(store, args.job[0], args.job[1], per=args.per, basis=args.basis, tenant=args.tenant,
                        step_size=step_size)
    except EnergyDiffError as exc:
        print(f"fleetscope energy diff: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()
    print(format_diff(d, args.top))
    return 0
