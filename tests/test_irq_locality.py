"""irq_rank_cpu_share and irq_time_rank_cpu_frac on real processes and real interrupts: two ranks, each a real process pinned to one CPU
with os.sched_setaffinity; the real /proc sampler publishes the CPU each last ran on (field 39 of stat); the
real host interrupts collector reads /proc/interrupts while the test makes the disk interrupt (fsync); the
real windows, feature builders and the scorer's RankContext join give each rank its CPUs' share of the
node's device interrupts. Nothing is stubbed."""
from __future__ import annotations

import os
import sys
import time
import uuid

import pytest

from fleetscope.eval.faults import SoftirqStorm
from fleetscope.producers.host.cpu_stat import CpuStatCollector
from fleetscope.producers.host.interrupts import InterruptsCollector
from fleetscope.producers.host.sampler import HostSampler
from fleetscope.producers.identity import IdentityResolver, IdentityRules
from fleetscope.producers.process_sampler import ProcessSampler, read_file
from fleetscope.producers.tracers.discovery import TargetSpec
from fleetscope.schema import NODE_TENANT
from fleetscope.streams.features import window_features
from fleetscope.streams.rank_context import RankContext
from fleetscope.streams.windows import WindowAssembler
from support.processes import NAP, last_cpu, pinned_ranks, spawn, wait_until  # noqa: F401 (spawn is a fixture)

SEC = 10**9


def numbered_irqs_per_cpu(batch) -> dict[int, float]:
    """From the host batch's own columns, independently of streams/irq_features.py."""
    c = batch.columns
    out: dict[int, float] = {}
    for metric, device, value in zip(c["metric"].to_numpy().tolist(), c["device"].to_numpy().tolist(),
                                     c["value"].tolist()):
        if metric == "irq.count":
            irq, cpu = device.split("@")
            if irq.isdigit():
                out[int(cpu[3:])] = out.get(int(cpu[3:]), 0.0) + value
    return out


def numbered_irq_total() -> int:
    total = 0
    for line in read_file("/proc/interrupts").decode().splitlines()[1:]:
        name, _, rest = line.partition(":")
        if name.strip().isdigit():
            total += sum(int(x) for x in rest.split() if x.isdigit())
    return total


def test_each_rank_gets_the_share_of_the_nodes_interrupts_that_landed_on_its_own_cpu(spawn, tmp_path):  # noqa: F811
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs to pin two ranks apart")
    job = f"irqtest-{uuid.uuid4().hex[:8]}"
    ranks = {}
    for rank, cpu in enumerate(cpus[:2]):
        env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")},
               "RANK": str(rank), "WORLD_SIZE": "2", "FLEETSCOPE_JOB": job}
        child = spawn(env, [sys.executable, "-c", NAP])
        os.sched_setaffinity(child.pid, {cpu})
        wait_until(lambda: last_cpu(child.pid) == cpu)
        ranks[rank] = (child.pid, cpu)
    procs = ProcessSampler("node-a", IdentityResolver(IdentityRules(), host="node-a"),
                           targets=TargetSpec(pids=tuple(pid for pid, _ in ranks.values())), poll_s=0.0)
    host = HostSampler("node-a", [InterruptsCollector()], use_cadence=False)
    t0 = (time.time_ns() // SEC - 60) * SEC
    assembler = WindowAssembler(window_s=1.0, allowed_lateness_s=0, idle_close_s=60)
    assert host.sample(t0 + 1) is None                       # the first read: no deltas yet
    before = numbered_irq_total()
    path = tmp_path / "irq.bin"
    with open(path, "wb") as f:                              # disk writes: the block device interrupts
        def more_irqs() -> bool:
            f.write(os.urandom(1 << 16))
            f.flush()
            os.fsync(f.fileno())
            return numbered_irq_total() > before
        wait_until(more_irqs, timeout_s=30)
    node_batch = host.sample(t0 + SEC // 2)
    expected = numbered_irqs_per_cpu(node_batch)
    assert sum(expected.values()) > 0, expected
    assembler.add(node_batch, None)
    for k in (1, 2):
        batch = procs.sample(t0 + k * SEC // 4)
        assert batch is not None
        assembler.add(batch, None)
    windows = [w for w in assembler.pop_closed(force=True) if w.start_ns == t0]
    node = [w for w in windows if w.key[0] == NODE_TENANT]
    rank_windows = {w.key[3]: w for w in windows if w.key[0] != NODE_TENANT}
    assert len(node) == 1 and sorted(rank_windows) == [0, 1], [w.key for w in windows]
    context = RankContext()
    context.remember(node[0], window_features(node[0]))
    total = sum(expected.values())
    for rank, (pid, cpu) in ranks.items():
        w = rank_windows[rank]
        assert [a.device for a in w.devices("proc", "proc.last_cpu")] == [f"cpu{cpu}"]
        joined = {**context.joined(w), **window_features(w)}
        assert joined["irq_rank_cpu_share"] == pytest.approx(expected.get(cpu, 0.0) / total)
        assert joined["irq_max_cpu_share"] == pytest.approx(max(expected.values()) / total)
    shares = [context.joined(rank_windows[r])["irq_rank_cpu_share"] for r in ranks]
    if len(cpus) == 2:   # the two ranks' CPUs are the whole node: their shares add up
        assert sum(shares) == pytest.approx(1.0)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="the flood pins processes to a CPU as the scenarios' injector does")
def test_a_rank_whose_cpu_does_network_receive_work_gets_that_cpus_interrupt_time(spawn):  # noqa: F811
    """The dev scenario irq_storm's fault for real: a loopback UDP flood pinned to rank 1's CPU makes NET_RX
    softirq work there and no device interrupt. The real /proc/stat collector's per-CPU softirq time, joined
    through RankContext, gives rank 1 that CPU's interrupt-time share and rank 0 its own quiet CPU's."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs to pin two ranks apart")
    ranks = pinned_ranks(spawn, cpus[:2], "irqtest")
    procs = ProcessSampler("node-a", IdentityResolver(IdentityRules(), host="node-a"),
                           targets=TargetSpec(pids=tuple(pid for pid, _ in ranks.values())), poll_s=0.0)
    host = HostSampler("node-a", [CpuStatCollector()], use_cadence=False)
    t0 = (time.time_ns() // SEC - 60) * SEC
    host.sample(t0 + 1)                                      # the first read: gauges only, no deltas yet
    storm = SoftirqStorm(ranks[1][0], strength=0.8, cpu=ranks[1][1], pin_rank=False)
    storm.start()
    try:
        time.sleep(2.0)
        node_batch = host.sample(t0 + SEC // 2)
    finally:
        storm.stop()
    assembler = WindowAssembler(window_s=1.0, allowed_lateness_s=0, idle_close_s=60)
    assembler.add(node_batch, None)
    for k in (1, 2):
        assembler.add(procs.sample(t0 + k * SEC // 4), None)
    windows = [w for w in assembler.pop_closed(force=True) if w.start_ns == t0]
    node = [w for w in windows if w.key[0] == NODE_TENANT]
    rank_windows = {w.key[3]: w for w in windows if w.key[0] != NODE_TENANT}
    context = RankContext()
    context.remember(node[0], window_features(node[0]))
    frac = {rank: context.joined(rank_windows[rank])["irq_time_rank_cpu_frac"] for rank in ranks}
    # measured here: 0.74 on the flooded CPU and 0.02 on the other (in the scenario, with the rank's own work
    # on that CPU too: 0.13-0.17 against 0.01 before the flood)
    assert frac[1] >= 0.03 and frac[1] > 3 * frac[0], frac



def _node_window(rows: list[tuple[str, str, str, float]]):
    """One node window from (source, metric, device, delta) rows through the real assembler."""
    from fleetscope.schema import node_identity
    from fleetscope.wire import Batch, StrColumn
    import numpy as np

    t0 = (time.time_ns() // SEC - 60) * SEC
    assembler = WindowAssembler(window_s=1.0, allowed_lateness_s=0, idle_close_s=60)
    for source in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == source]
        n = len(mine)
        metrics, devices = sorted({r[1] for r in mine}), sorted({r[2] for r in mine})
        cols = {"ts_ns": np.full(n, t0 + SEC // 2, dtype="<i8"), **node_identity("node-a", n),
                "metric": StrColumn(np.array([metrics.index(r[1]) for r in mine], dtype=np.uint32), tuple(metrics)),
                "device": StrColumn(np.array([devices.index(r[2]) for r in mine], dtype=np.uint32), tuple(devices)),
                "value": np.array([r[3] for r in mine], dtype=float), "interval_ns": np.full(n, SEC, dtype="<i8")}
        assembler.add(Batch(source, "node-a", cols), None)
    (w,) = assembler.pop_closed(force=True)
    return w


def test_interrupts_that_all_land_on_one_cpu_are_the_most_concentrated_not_missing():
    """The kernel tracer lists only CPUs that took interrupts. This VM steers every device interrupt to cpu1,
    so its counts named one CPU, and the busiest CPU's share read as missing: the worst concentration could
    never match irq_locality_miss. The host rows name every online CPU; the quiet ones count at 0."""
    from fleetscope.streams.irq_features import node_irq_time_per_cpu, node_irqs_per_cpu

    w = _node_window([("kernel", "kernel.irq_count", "cpu1", 25.0),
                      ("host", "irq.cpu_total", "cpu0", 900.0), ("host", "irq.cpu_total", "cpu1", 1200.0),
                      ("host", "cpu.softirq", "cpu0", 0.01), ("host", "cpu.softirq", "cpu1", 0.15),
                      ("host", "cpu.irq", "cpu1", 0.02)])
    assert node_irqs_per_cpu(w) == {0: 0.0, 1: 25.0}
    assert window_features(w)["irq_max_cpu_share"] == 1.0
    assert node_irq_time_per_cpu(w) == {0: pytest.approx(0.01), 1: pytest.approx(0.17)}
    # a one-CPU node has no concentration to speak of
    assert "irq_max_cpu_share" not in window_features(_node_window([("kernel", "kernel.irq_count", "cpu0", 25.0)]))
