"""Load from outside the job on its hosts: the CPU a host spends on anything but the job's own ranks.

A noisy neighbour that is not part of the job (another tenant's process, a runaway daemon) slows every rank on
its host alike: no rank differs from its peers, the ranks' own vectors barely move, and a slowdown of a tenth is
under what the job's rate alone may call a fault (job_rate.py). Measured in the dev scenario outside_load_node
(three busy loops beside the job for 30 s, the job 10% slower): the rank models flagged 7 of its 90 rank-windows,
and the node's model flagged its node for 20 windows, which no rank took (scoring._attribute_node gives role
node only when every rank of the host is flagged). What the host shows is plain: its busy CPU rose by 0.9 of a
core while the job's ranks used no more.

Per job step and host:

    outside_cpu_cores = the host's busy cores (cpu_busy_cores) - the cores the job's ranks on it used
                        (proc_cpu_cores, summed)

judged against the (job, host)'s own history as the job's rate is (job_rate.OwnHistory: a median/MAD baseline,
frozen while a change lasts, a change that keeps its own level). A change begins where the outside load rose by
``z_enter`` robust deviations and at least ``min_rise_cores`` while the job runs at least ``min_slowdown``
slower than its own baseline (``job_iteration_time_ratio``): a neighbour the job does not feel has no impact on
it. It lasts while the load stays ``z_exit`` deviations up or nearer its own level than the baseline, and is
taken as the host's new normal after ``regime_windows`` windows in a row (the job rate's slowdown setting).

What counts as outside: everything but the job's rank processes (proc_cpu_cores sums a rank's processes, its
DataLoader workers too): the agent itself, other jobs, daemons. Those are part of the baseline while they stay as
they are. Where several jobs share a host, each is judged on its own: for one, the others are outside.

A host the job has not had a rank on for ``forget_host_s`` (an hour) is forgotten, so an elastic job that moves
across many hosts holds no history for the ones it left; coming back, it warms up again (``warmup`` windows).

Checkpointed with the job's model (a part: per host its history, change counter and change sum).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from fleetscope.streams.model.checkpoint import JobPart
from fleetscope.streams.model.job_rate import OwnHistory, saved_newest

BUSY = "cpu_busy_cores"      # the host's, joined into each rank's vector (host_features)
RANK_CPU = "proc_cpu_cores"  # each rank process's own (proc_features)


@dataclass
class OutsideVerdict:
    flagged: bool
    features: dict[str, float]   # outside_cpu_cores, and once warm outside_cpu_z and outside_cpu_rise_cores


class OutsideLoad:
    def __init__(self, warmup: int = 10, z_enter: float = 6.0, z_exit: float = 3.0, history: int = 60,
                 regime_windows: int = 300, min_rise_cores: float = 0.5, min_slowdown: float = 0.05,
                 forget_host_s: float = 3600.0):
        self.warmup = warmup
        self.z_enter = z_enter
        self.z_exit = z_exit
        self.history_len = history
        self.regime_windows = regime_windows
        self.min_rise_cores = min_rise_cores
        self.min_slowdown = min_slowdown
        self.forget_host_ns = int(forget_host_s * 1e9)
        self.jobs: dict[tuple[str, str], dict[str, OwnHistory]] = {}
        self.host_seen: dict[tuple[str, str], dict[str, int]] = {}   # job -> host -> newest step start with it
        self.newest: dict[tuple[str, str], int] = {}
        self.counts = {"windows": 0, "flagged": 0, "regimes": 0}

    def step(self, job: tuple[str, str], start_ns: int, hosts: Sequence[str], vectors: Sequence[Mapping[str, float]],
             iteration_time_ratio: float | None) -> dict[str, OutsideVerdict]:
        """Judge one job step, per host of its ranks (`hosts[i]` is the host of `vectors[i]`); hosts whose
        load cannot be told (no host busy cores, a rank without its own CPU) are left out."""
        if start_ns <= self.newest.get(job, -1):
            return {}
        self.newest[job] = start_ns
        slowed = iteration_time_ratio is not None and iteration_time_ratio >= 1.0 + self.min_slowdown
        histories = self.jobs.setdefault(job, {})
        seen = self.host_seen.setdefault(job, {})
        out = {}
        for host, x in outside_cores(hosts, vectors).items():
            hist = histories.get(host)
            if hist is None:
                hist = histories[host] = OwnHistory(self.history_len)
            seen[host] = start_ns
            out[host] = self._judge(hist, x, slowed)
        for host in [h for h in histories if start_ns - seen.setdefault(h, start_ns) > self.forget_host_ns]:
            del histories[host], seen[host]
        return out

    def _judge(self, hist: OwnHistory, x: float, slowed: bool) -> OutsideVerdict:
        self.counts["windows"] += 1
        features = {"outside_cpu_cores": x}
        if len(hist.values) < self.warmup:
            hist.values.append(x)
            return OutsideVerdict(False, features)
        base, scale = hist.baseline()
        z, rise = (x - base) / scale, x - base
        if hist.in_change:
            flagged = z >= self.z_exit or hist.nearer_change(x, base)
        else:
            flagged = z >= self.z_enter and rise >= self.min_rise_cores and slowed
        flagged, regime = hist.settle(x, flagged, self.regime_windows)
        self.counts["regimes"] += regime
        self.counts["flagged"] += flagged
        features.update(outside_cpu_z=z, outside_cpu_rise_cores=rise)
        return OutsideVerdict(flagged, features)

    # ---- checkpoint part (model/checkpoint.py) ------------------------------------------------------
    def part(self, job: tuple[str, str]) -> JobPart:
        return JobPart(self, job)

    def state(self, job: tuple[str, str]) -> tuple[dict, dict[str, np.ndarray]]:
        hists = self.jobs.get(job, {})
        hosts = sorted(hists)
        meta = {"newest": self.newest.get(job, -1), "hosts": hosts,
                "in_change": [hists[h].in_change for h in hosts], "change_sum": [hists[h].change_sum for h in hosts]}
        return meta, {f"history_{i}": np.array(hists[h].values, dtype=np.float64) for i, h in enumerate(hosts)}

    def load(self, job: tuple[str, str], meta: dict, arrays) -> None:
        newest = saved_newest(meta, arrays)
        hosts, in_change, sums = meta.get("hosts"), meta.get("in_change"), meta.get("change_sum")
        if not (isinstance(hosts, list) and all(isinstance(h, str) for h in hosts)
                and isinstance(in_change, list) and isinstance(sums, list) and len(in_change) == len(sums) == len(hosts)):
            arrays.fail("hosts, in_change and change_sum: lists of one entry per host")
        hists = {}
        for i, host in enumerate(hosts):
            counters = {"in_change": in_change[i], "change_sum": sums[i]}   # one host's, read as a meta's
            hists[host] = OwnHistory.restored(self.history_len, arrays, f"history_{i}",
                                              arrays.count(counters, "in_change", 1 << 31),
                                              arrays.number(counters, "change_sum"))
        self.jobs[job] = hists
        self.newest[job] = newest

    def forget(self, job: tuple[str, str]) -> None:
        self.jobs.pop(job, None)
        self.newest.pop(job, None)
        self.host_seen.pop(job, None)


def outside_cores(hosts: Sequence[str], vectors: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Per host: its busy cores less its ranks' own, where every rank there reports its CPU."""
    busy: dict[str, float] = {}
    ranks: dict[str, float] = {}
    whole: dict[str, bool] = {}
    for host, v in zip(hosts, vectors):
        b, own = v.get(BUSY), v.get(RANK_CPU)
        if b is not None and math.isfinite(float(b)):
            busy[host] = float(b)
        if own is None or not math.isfinite(float(own)):
            whole[host] = False
            continue
        ranks[host] = ranks.get(host, 0.0) + float(own)
        whole.setdefault(host, True)
    return {h: busy[h] - ranks[h] for h in busy if whole.get(h)}
