"""Energy per operator: a rank window's GPU energy split over the operators that ran there.

Magneton's idea (differential energy debugging) needs energy per operator,
which no counter gives: NVML reports a GPU's energy, and the agent splits it
per process (nvml.proc_energy_j, by SM utilization). Here, per rank and
window, that energy is split further by each operator's share of the
rank's GPU-busy time, estimated from what the tracers see:

- basis "torch": PyTorch ops, weighted by torch.op_ns (time between the op's
  Python binding's entry and return, per op name);
- basis "cuda": kernel names, weighted by their launch time: cuda.launches per
  kernel name times the mean duration of a launch call (cuda.dur_ns over
  cuda.calls of the launch APIs), i.e. by launch count.

Each basis that has rows gets its own split (the two are not added up). When
NVML gives the rank's SM utilization, only the busy part of the energy
(E x SM util) goes to the operators and the rest to "(idle)": energy the GPU
drew while no kernel of this rank ran (static power, waits on input or peers).

What this misses (README, Energy per operator): host-side times are not GPU
times. An asynchronous CUDA op returns once queued, so torch.op_ns measures
dispatch, and a launch count treats every kernel of the window as equally
long; a kernel's real GPU time and power draw (a tensor-core GEMM draws more
watts than a memcpy-bound elementwise kernel) are not seen without CUPTI or
per-kernel timing. Overlapping kernels (streams) and communication kernels
share the same busy time; "backward" is one op for the whole backward pass;
idle power inside a busy period is spread over the operators by share.

Work done per window, for normalising two runs against each other (the
workload's own step counter is not in the store): `collectives`, the NCCL
collective calls of the window (about one all-reduce per step, or a fixed
number per step under DDP's bucketing), and `ops`, the torch op calls (or
CUDA kernel launches when there is no torch source).
"""
from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from fleetscope.wire import Batch, StrColumn
from fleetscope.streams.trace_features import COLLECTIVES, LAUNCH_APIS, _deltas, _sum
from fleetscope.streams.windows import Window

OPERATOR_CAP = 24   # operators kept per rank, window and basis; the rest are summed as "(other)"
IDLE, OTHER = "(idle)", "(other)"
ENERGY_ROWS = "operator_energy"  # the extras tag of an energy batch on <prefix>.features


class OperatorEnergy(NamedTuple):
    basis: str        # "torch" | "cuda"
    operator: str
    busy_ns: float    # the operator's weight: torch op time, or launches x mean launch call time
    share: float      # of the rank's energy in the window
    energy_j: float


def rank_energy_j(w: Window) -> float | None:
    """The rank's GPU energy in the window (its processes' shares, from the NVML sampler)."""
    return _sum(w, "nvml", "nvml.proc_energy_j")


def busy_fraction(w: Window) -> float | None:
    """The rank's mean SM utilization in the window, 0..1 (NVML's per-process samples)."""
    means = [a.gauge_sum / a.gauge_n for a in w.devices("nvml", "nvml.proc_sm_util") if a.gauge_n]
    return None if not means else min(max(sum(means) / 100.0, 0.0), 1.0)


def operator_weights(w: Window) -> dict[str, dict[str, float]]:
    """basis -> {operator: busy ns} for every basis with rows in the window."""
    out: dict[str, dict[str, float]] = {}
    if "torch" in w.sources:
        ops = {a.device: a.delta_sum for a in _deltas(w, "torch", "torch.op_ns") if a.delta_sum > 0}
        if ops:
            out["torch"] = ops
    if "cuda" in w.sources:
        launches = {a.device: a.delta_sum for a in _deltas(w, "cuda", "cuda.launches") if a.delta_sum > 0}
        calls = _sum(w, "cuda", "cuda.calls", LAUNCH_APIS)
        call_ns = _sum(w, "cuda", "cuda.dur_ns", LAUNCH_APIS)
        if launches:
            per_launch = call_ns / calls if calls and call_ns else 1.0  # no call timing: by count alone
            out["cuda"] = {k: n * per_launch for k, n in launches.items()}
    return out


def split_energy(energy_j: float, weights: dict[str, float], busy: float | None,
                 cap: int = OPERATOR_CAP) -> list[tuple[str, float, float, float]]:
    """(operator, weight, share, joules): `energy_j` x busy over the operators by weight, the rest to IDLE.

    The `cap` heaviest operators are kept by name, the others summed as OTHER. Shares sum to 1."""
    total = sum(weights.values())
    if total <= 0:
        return []
    ranked = sorted(weights.items(), key=lambda kv: (-kv[1], kv[0]))
    kept = ranked[:cap]
    rest = sum(v for _, v in ranked[cap:])
    if rest > 0:
        kept.append((OTHER, rest))
    busy_share = 1.0 if busy is None else busy
    out = [(op, v, busy_share * v / total, energy_j * busy_share * v / total) for op, v in kept]
    if busy is not None and busy < 1.0:
        out.append((IDLE, 0.0, 1.0 - busy, energy_j * (1.0 - busy)))
    return out


def work_units(w: Window) -> tuple[float, float]:
    """(collectives, ops) done in the window: NCCL collective calls; torch op calls, else CUDA launches."""
    collectives = _sum(w, "nccl", "nccl.calls", COLLECTIVES) if "nccl" in w.sources else None
    ops = _sum(w, "torch", "torch.ops") if "torch" in w.sources else None
    if ops is None and "cuda" in w.sources:
        ops = _sum(w, "cuda", "cuda.launches")
    return float(collectives or 0.0), float(ops or 0.0)


def operator_energy(w: Window) -> list[OperatorEnergy]:
    """The window's energy per operator, per basis; empty without GPU energy or operator timings."""
    if "nvml" not in w.sources:
        return []
    energy = rank_energy_j(w)
    if energy is None:
        return []
    busy = busy_fraction(w)
    return [OperatorEnergy(basis, op, weight, share, joules)
            for basis, weights in operator_weights(w).items()
            for op, weight, share, joules in split_energy(energy, weights, busy)]


def energy_batch(worker_host: str, windows, feature_version: int) -> Batch | None:
    """The rank windows' operator energy as one batch for <prefix>.features (extras rows=operator_energy,
    one row per window, basis and operator), or None when no window has any."""
    rows = []
    for w in windows:
        found = operator_energy(w)
        if found:
            collectives, ops = work_units(w)
            rows += [(w, e, collectives, ops) for e in found]
    if not rows:
        return None
    cols = {
        "window_start_ns": np.array([w.start_ns for w, _, _, _ in rows], dtype="<i8"),
        "window_end_ns": np.array([w.end_ns for w, _, _, _ in rows], dtype="<i8"),
        "tenant": StrColumn.of([w.key[0] for w, _, _, _ in rows]),
        "job": StrColumn.of([w.key[1] for w, _, _, _ in rows]),
        "host": StrColumn.of([w.key[2] for w, _, _, _ in rows]),
        "rank": np.array([w.key[3] for w, _, _, _ in rows], dtype="<i4"),
        "basis": StrColumn.of([e.basis for _, e, _, _ in rows]),
        "operator": StrColumn.of([e.operator for _, e, _, _ in rows]),
        "busy_ns": np.array([e.busy_ns for _, e, _, _ in rows], dtype="<f8"),
        "share": np.array([e.share for _, e, _, _ in rows], dtype="<f8"),
        "energy_j": np.array([e.energy_j for _, e, _, _ in rows], dtype="<f8"),
        "collectives": np.array([c for _, _, c, _ in rows], dtype="<f8"),
        "ops": np.array([o for _, _, _, o in rows], dtype="<f8"),
        "emitted_at_ns": np.full(len(rows), time.time_ns(), dtype="<i8"),
    }
    return Batch("features", worker_host, cols, extras={"feature_version": feature_version, "rows": ENERGY_ROWS})


def is_energy_batch(batch: Batch) -> bool:
    return batch.extras.get("rows") == ENERGY_ROWS
