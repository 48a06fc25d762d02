"""Which ranks a neighbour outside the job sits beside (streams/cpu_features.py, model/locality.py).

The share of each rank's CPUs that outside work took, on real processes: three "ranks" (real processes pinned
with os.sched_setaffinity, rank 0 alone on one CPU, ranks 1 and 2 on the other), two real busy loops outside
the job pinned beside rank 0 (the scenarios' own CompetingLoad injector), the real /proc/stat collector and /proc
sampler, the real windows and the scorer's RankContext. Then the split and the memory of it on the numbers the
dev scenarios measured."""
from __future__ import annotations

import os
import time
from types import SimpleNamespace

import numpy as np
import pytest

from fleetscope.eval.faults import CompetingLoad
from fleetscope.producers.host.cpu_stat import CpuStatCollector
from fleetscope.producers.host.sampler import HostSampler
from fleetscope.producers.identity import IdentityResolver, IdentityRules
from fleetscope.producers.process_sampler import ProcessSampler
from fleetscope.producers.tracers.discovery import TargetSpec
from fleetscope.schema import NODE_TENANT
from fleetscope.streams.cpu_features import node_busy_per_cpu, outside_rank_cpu_fracs
from fleetscope.streams.features import window_features
from fleetscope.streams.model import JobModel, ModelConfig
from fleetscope.streams.model.locality import OUTSIDE_FEATURE, NeighbourPlacement
from fleetscope.streams.model.state_archive import CheckpointError
from fleetscope.streams.rank_context import RankContext
from fleetscope.streams.windows import WindowAssembler
from support.processes import pinned_ranks, spawn  # noqa: F401 (spawn is a fixture)

SEC = 10**9


def per_cpu_busy_from_rows(batch) -> dict[int, float]:
    """From the host batch's own columns, independently of streams/cpu_features.py."""
    c = batch.columns
    busy: dict[int, list[float]] = {}
    for metric, device, value in zip(c["metric"].to_numpy().tolist(), c["device"].to_numpy().tolist(),
                                     c["value"].tolist()):
        if metric.startswith("cpu.") and device.startswith("cpu") and metric[4:] in (
                "user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"):
            b = busy.setdefault(int(device[3:]), [0.0, 0.0])
            b[metric in ("cpu.idle", "cpu.iowait")] += value
    return {cpu: b / (b + i) for cpu, (b, i) in busy.items()}


def test_the_rank_beside_a_pinned_neighbour_gets_its_cpus_outside_share(spawn):  # noqa: F811
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs to pin ranks apart")
    alone, shared = cpus[1], cpus[0]
    ranks = {rank: pid for rank, (pid, _) in pinned_ranks(spawn, [alone, shared, shared], "placement").items()}
    procs = ProcessSampler("node-a", IdentityResolver(IdentityRules(), host="node-a"),
                           targets=TargetSpec(pids=tuple(ranks.values())), poll_s=0.0)
    host = HostSampler("node-a", [CpuStatCollector()], use_cadence=False)
    t0 = (time.time_ns() // SEC - 60) * SEC
    neighbour = CompetingLoad(None, strength=1.0, hogs=2, cpu=alone)
    neighbour.start()
    try:
        host.sample(t0 + 1)                                  # the first read: no deltas yet
        assert procs.sample(t0 + SEC // 8) is not None       # the sampler's first CPU reading
        time.sleep(1.5)
        node_batch = host.sample(t0 + SEC // 2)
        rank_batch = procs.sample(t0 + 3 * SEC // 4)
    finally:
        neighbour.stop()
    assembler = WindowAssembler(window_s=1.0, allowed_lateness_s=0, idle_close_s=60)
    assembler.add(node_batch, None)
    assembler.add(rank_batch, None)
    windows = [w for w in assembler.pop_closed(force=True) if w.start_ns == t0]
    node = [w for w in windows if w.key[0] == NODE_TENANT]
    rank_windows = sorted((w for w in windows if w.key[0] != NODE_TENANT), key=lambda w: w.key[3])
    assert len(node) == 1 and [w.key[3] for w in rank_windows] == [0, 1, 2], [w.key for w in windows]
    busy = per_cpu_busy_from_rows(node_batch)
    assert node_busy_per_cpu(node[0]) == pytest.approx(busy)
    context = RankContext()
    context.remember(node[0], window_features(node[0]))
    vectors = [window_features(w) for w in rank_windows]
    fracs = context.outside_on_rank_cpus(rank_windows, vectors)
    own = [v["proc_cpu_cores"] for v in vectors]
    # each CPU's busy share less the ranks' own there, as the rows say (rank 0 alone on its CPU)
    assert fracs[0] == pytest.approx(max(0.0, busy[alone] - own[0]))
    assert fracs[1] == fracs[2] == pytest.approx(max(0.0, busy[shared] - own[1] - own[2]))
    # two busy loops on rank 0's CPU keep it busy whatever else runs (a loaded CI machine fills the other too)
    assert fracs[0] >= 0.9 and fracs[0] >= fracs[1], fracs


def test_outside_share_spreads_a_ranks_cpu_over_the_cpus_it_was_seen_on():
    busy = {0: 0.75, 1: 1.0}
    vectors = [{"proc_cpu_cores": 0.15}, {"proc_cpu_cores": 0.15}, {"proc_cpu_cores": 0.15}]
    # rank 0 beside the neighbour on cpu1, ranks 1 and 2 on cpu0 (noisy_neighbour_pinned, measured)
    assert outside_rank_cpu_fracs(busy, [{1}, {0}, {0}], vectors) == pytest.approx([0.85, 0.45, 0.45])
    # rank 2 seen on both CPUs: half its CPU counts on each, and it sits halfway
    assert outside_rank_cpu_fracs(busy, [{1}, {0}, {0, 1}], vectors) == pytest.approx([0.775, 0.525, 0.65])


def test_outside_share_is_unknown_without_the_rank_cpu_or_the_per_cpu_counters():
    vectors = [{"proc_cpu_cores": 0.15}, {}, {"proc_cpu_cores": 0.15}]
    assert outside_rank_cpu_fracs({0: 0.5, 1: 1.0}, [{1}, {0}, {0}], vectors) == [None, None, None]
    assert outside_rank_cpu_fracs({}, [{1}, {0}, {0}], [{"proc_cpu_cores": 0.1}] * 3) == [None, None, None]
    # a rank whose CPUs are unknown has no share, and its CPU is nobody's
    assert outside_rank_cpu_fracs({0: 0.5, 1: 1.0}, [{1}, set(), {0}], vectors) == pytest.approx([0.85, None, 0.35])
    # a CPU the host rows do not name says nothing of the rank on it
    assert outside_rank_cpu_fracs({0: 0.5}, [{1}], [{"proc_cpu_cores": 0.1}]) == [None]


def evidence(*shares):
    return [{OUTSIDE_FEATURE: s} if s is not None else {} for s in shares]


def test_a_wide_gap_names_the_rank_beside_the_neighbour_and_a_narrow_one_names_none():
    placement = NeighbourPlacement()
    assert placement.place("a", [0, 1, 2], [0, 1, 2], evidence(0.86, 0.37, 0.37)) == [0]
    fresh = NeighbourPlacement()
    # free busy loops (outside_load_node): the widest gap measured, 0.66 against 0.43, names nobody
    assert fresh.place("a", [0, 1, 2], [0, 1, 2], evidence(0.66, 0.43, 0.43)) == []
    # the neighbour's CPU shared by most ranks is the host's load, not one rank's
    assert fresh.place("a", [0, 1, 2], [0, 1, 2], evidence(0.86, 0.86, 0.37)) == []


def test_a_rank_seen_halfway_keeps_the_named_rank_until_the_shares_say_otherwise():
    placement = NeighbourPlacement()
    rows, ranks = [0, 1, 2], [5, 6, 7]
    assert placement.place("a", rows, ranks, evidence(0.86, 0.37, 0.37)) == [0]
    # a peer seen on the neighbour's CPU too sits halfway (measured: 0.77, 0.56, 0.67): still rank 5's
    assert placement.place("a", rows, ranks, evidence(0.77, 0.56, 0.67)) == [0]
    assert placement.place("a", rows, ranks, evidence(0.72, 0.72, 0.72)) == [0]   # a tie does not contradict it
    # rows come in another order in the next step: the rank is remembered, not the row
    assert placement.place("a", [0, 1, 2], [6, 5, 7], evidence(0.6, 0.8, 0.6)) == [1]
    # another rank now carries more: nobody is named from memory
    assert placement.place("a", rows, ranks, evidence(0.6, 0.7, 0.5)) == []
    assert placement.place("a", rows, ranks, evidence(None, 0.4, 0.4)) == []    # its share unknown
    placement.forget("a")   # the host's outside load ended
    assert placement.place("a", rows, ranks, evidence(0.77, 0.56, 0.67)) == []
    assert placement.place("b", rows, ranks, evidence(0.77, 0.56, 0.67)) == []   # per host


def test_placements_kept_are_bounded():
    placement = NeighbourPlacement(capacity=2)
    for host in "abc":
        placement.place(host, [0, 1, 2], [0, 1, 2], evidence(0.9, 0.3, 0.3))
    assert list(placement.ranks) == ["b", "c"]


def test_named_ranks_travel_in_the_jobs_checkpoint_and_a_forged_part_is_refused():
    job, other = ("acme", "train"), ("acme", "eval")
    placement = NeighbourPlacement()
    rows, ranks = [0, 1, 2], [5, 6, 7]
    assert placement.place((*job, "node-a"), rows, ranks, evidence(0.86, 0.37, 0.37)) == [0]
    assert placement.place((*job, "node-b"), rows, [8, 9, 10], evidence(0.3, 0.3, 0.9)) == [2]
    placement.place((*other, "node-a"), rows, ranks, evidence(0.3, 0.9, 0.3))
    blob = JobModel(ModelConfig(warmup_windows=5)).to_bytes({"placement": placement.part(job)})
    restored = NeighbourPlacement()
    JobModel.from_bytes(blob, {"placement": restored.part(job)})
    assert restored.ranks == {(*job, "node-a"): frozenset({5}), (*job, "node-b"): frozenset({10})}
    # a window that does not split: the restored worker still names the rank, one that relearnt does not
    halfway = evidence(0.77, 0.56, 0.67)
    assert restored.place((*job, "node-a"), rows, ranks, halfway) == [0]
    assert NeighbourPlacement().place((*job, "node-a"), rows, ranks, halfway) == []
    # a part written by someone else (the state topic is writable by others): a one-line error, nothing kept
    forged = SimpleNamespace(state=lambda: ({"hosts": "node-a"}, {}))
    with pytest.raises(CheckpointError, match="hosts"):
        JobModel.from_bytes(JobModel(ModelConfig()).to_bytes({"placement": forged}),
                            {"placement": NeighbourPlacement().part(job)})
    wrong = SimpleNamespace(state=lambda: ({"hosts": ["node-a"]}, {"ranks_0": np.ones(2)}))
    with pytest.raises(CheckpointError, match="ranks_0"):
        JobModel.from_bytes(JobModel(ModelConfig()).to_bytes({"placement": wrong}),
                            {"placement": NeighbourPlacement().part(job)})
