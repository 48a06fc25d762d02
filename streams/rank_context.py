"""What a rank's vector is joined with: its node's window and its own GPU's.

Node windows (host counters, device-level NVML, the kernel tracer's per-CPU
IRQs) arrive keyed by host; they are remembered here per (host, window start)
and joined into each of that host's rank windows of the same start, as
evidence for diagnosis and the loud-failure checks. A rank's own GPU is the
device label of its NVML process rows (``gpu<N>``); when it is known, the
node-wide GPU features are replaced by that GPU's, so an Xid on GPU 0 is not
blamed on the rank of GPU 1. A node with one GPU needs no label. The node's
interrupts per CPU are kept too, and each rank gets the share that landed on
the CPUs it ran on (``irq_rank_cpu_share``, streams/irq_features.py), and the
share of those CPUs' time that went to interrupt work (``irq_time_rank_cpu_frac``).

The joined features are not model inputs (host features in the model flagged
whole jobs whenever a host got busy); their peer z-scores across the job's
ranks (``joined_peer_z``) are computed here so KB rules can compare ranks on
them (a rank on a hot GPU, a node without huge pages).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Mapping, Sequence

from fleetscope.streams.feature_catalogue import JOINED_FEATURES, RANK_JOIN_FEATURES
from fleetscope.streams.gpu_features import DEVICE_GAUGES, FAULT_FEATURES, gpu_device_features
from fleetscope.streams.cpu_features import node_busy_per_cpu, outside_rank_cpu_fracs, rank_cpus
from fleetscope.streams.irq_features import (irq_max_cpu_share, irq_rank_cpu_share, irq_time_rank_cpu_frac,
                                             node_irq_time_per_cpu, node_irqs_per_cpu)
from fleetscope.streams.windows import Window

NODE_CACHE = 20_000  # (host, window) node vectors kept for joining
PROC_METRICS = ("nvml.proc_sm_util", "nvml.proc_mem_used", "nvml.proc_energy_j")
PER_GPU = frozenset(name for _, name in DEVICE_GAUGES) | frozenset(FAULT_FEATURES) | {"gpu_throttled"}
MIN_PEERS = 3
MAD_TO_SIGMA = 1.4826
REL_FLOOR = 0.02


def rank_gpus(w: Window) -> list[str]:
    """The GPU labels of the rank's NVML process rows, in order of first sight."""
    if "nvml" not in w.sources:
        return []
    labels: dict[str, None] = {}
    for metric in PROC_METRICS:
        for a in w.devices("nvml", metric):
            if a.device.startswith("gpu"):
                labels[a.device] = None
    return list(labels)


class RankContext:
    def __init__(self, capacity: int = NODE_CACHE):
        self.capacity = capacity
        self.node: OrderedDict[tuple[str, int], dict] = OrderedDict()
        self.gpus: dict[tuple[str, int], dict[str, dict[str, float]]] = {}
        self.irqs: dict[tuple[str, int], dict[int, float]] = {}
        self.irq_time: dict[tuple[str, int], dict[int, float]] = {}
        self.busy: dict[tuple[str, int], dict[int, float]] = {}
        # each rank's GPUs as last named by its NVML process rows: a window without them (the process ended
        # in it, or a sample missed it) keeps the rank on its GPUs, or an Xid that ends the rank's process is
        # never the rank's (measured in xid_fallen_off_bus: the dying rank had no process row in the Xid's window)
        self.last_gpus: OrderedDict[tuple, list[str]] = OrderedDict()
        self.misses = 0

    def remember(self, w: Window, vector: dict) -> None:
        key = (w.key[2], w.start_ns)
        self.node[key] = vector
        self.gpus[key] = gpu_device_features(w)
        self.irqs[key] = node_irqs_per_cpu(w)
        self.irq_time[key] = node_irq_time_per_cpu(w)
        self.busy[key] = node_busy_per_cpu(w)
        while len(self.node) > self.capacity:
            old, _ = self.node.popitem(last=False)
            for per_node in (self.gpus, self.irqs, self.irq_time, self.busy):
                per_node.pop(old, None)

    def joined(self, w: Window) -> dict[str, float] | None:
        """The node's features with the rank's own GPU's in place of the node-wide ones; None when the
        node's window of this start is not (yet) here."""
        key = (w.key[2], w.start_ns)
        node = self.node.get(key)
        if node is None:
            self.misses += 1
            return None
        out = {**node, **self._irq_shares(key, w)}
        devices = self.gpus.get(key, {})
        own = [devices[g] for g in self._gpus_of(w) if g in devices]
        if not own and len(devices) == 1:
            own = list(devices.values())
        if not own:
            # the rank's GPU is unknown in this window (no NVML process row: a process ending, a missed
            # sample) on a node of several: the node's gauges stand in, but not its GPUs' faults, or an Xid
            # on one GPU flags every such rank of the node (measured: two in a run of xid_fallen_off_bus)
            return {k: v for k, v in out.items() if k not in FAULT_FEATURES}
        out = {k: v for k, v in out.items() if k not in PER_GPU}
        for name in PER_GPU:
            values = [d[name] for d in own if name in d]
            if values:
                out[name] = max(values) if name in FAULT_FEATURES or name == "gpu_throttled" \
                    else sum(values) / len(values)
        return out

    def outside_on_rank_cpus(self, windows: Sequence[Window], vectors: Sequence[Mapping[str, float]]) \
            -> list[float | None]:
        """Per rank window of one job step (`vectors[i]` its vector), the share of its CPUs' time that went to
        work outside the job (cpu_features.outside_rank_cpu_fracs, per host); None where it cannot be told."""
        out: list[float | None] = [None] * len(windows)
        by_host: dict[tuple[str, int], list[int]] = {}
        for i, w in enumerate(windows):
            by_host.setdefault((w.key[2], w.start_ns), []).append(i)
        for key, rows in by_host.items():
            fracs = outside_rank_cpu_fracs(self.busy.get(key, {}), [rank_cpus(windows[i]) for i in rows],
                                           [vectors[i] for i in rows])
            for i, frac in zip(rows, fracs):
                out[i] = frac
        return out

    def _gpus_of(self, w: Window) -> list[str]:
        """This window's GPUs of the rank, remembered; else the ones its last process rows named."""
        gpus = rank_gpus(w)
        if gpus:
            self.last_gpus[w.key] = gpus
            self.last_gpus.move_to_end(w.key)
            while len(self.last_gpus) > self.capacity:
                self.last_gpus.popitem(last=False)
            return gpus
        return self.last_gpus.get(w.key, [])

    def _irq_shares(self, key: tuple[str, int], w: Window) -> dict[str, float]:
        """The rank's CPUs' share of the node's interrupts and their interrupt time; the busiest CPU's share
        from the host rows when the kernel tracer (which gives it on the node's window) does not run."""
        irqs = self.irqs.get(key, {})
        out = {}
        cpus = rank_cpus(w)
        share = irq_rank_cpu_share(irqs, cpus)
        if share is not None:
            out["irq_rank_cpu_share"] = share
        frac = irq_time_rank_cpu_frac(self.irq_time.get(key, {}), cpus)
        if frac is not None:
            out["irq_time_rank_cpu_frac"] = frac
        if "irq_max_cpu_share" not in self.node[key]:
            busiest = irq_max_cpu_share(irqs)
            if busiest is not None:
                out["irq_max_cpu_share"] = busiest
        return out


def joined_peer_z(vectors: Sequence[Mapping[str, float]]) -> list[dict[str, float]]:
    """Robust z of each joined feature against the step's ranks: (x - median) / max(1.4826 MAD, 2% of
    |median|); features seen on fewer than MIN_PEERS ranks get none."""
    out: list[dict[str, float]] = [{} for _ in vectors]
    for name in JOINED_FEATURES | RANK_JOIN_FEATURES:
        rows = [(i, float(v[name])) for i, v in enumerate(vectors)
                if name in v and math.isfinite(float(v[name]))]
        if len(rows) < MIN_PEERS:
            continue
        values = sorted(x for _, x in rows)
        median = _median(values)
        mad = _median(sorted(abs(x - median) for x in values))
        scale = max(MAD_TO_SIGMA * mad, REL_FLOOR * abs(median), 1e-9)
        for i, x in rows:
            z = (x - median) / scale
            if z:
                out[i][name] = z
    return out


JOB_MEANS = (("gpu_ofu", "job_gpu_ofu"), ("gpu_tensor_util", "job_gpu_tensor_util"))


def job_gpu_means(vectors: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The job's OFU and tensor activity in one window: the mean over its ranks of each rank's own GPU's
    (joined vectors; ranks without the value, e.g. no GPM, are left out, and none gives no key). Ranks
    sharing a GPU count it once each, as each rank's work runs on it."""
    out: dict[str, float] = {}
    for name, job_name in JOB_MEANS:
        values = [float(v[name]) for v in vectors if name in v and math.isfinite(float(v[name]))]
        if values:
            out[job_name] = sum(values) / len(values)
    return out


def _median(sorted_values: list[float]) -> float:
    n = len(sorted_values)
    return 0.5 * (sorted_values[(n - 1) // 2] + sorted_values[n // 2])
