"""irq_rank_cpu_share on real processes and real interrupts: two ranks, each a real process pinned to one CPU
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

from fleetscope.producers.host.interrupts import InterruptsCollector
from fleetscope.producers.host.sampler import HostSampler
from fleetscope.producers.identity import IdentityResolver, IdentityRules
from fleetscope.producers.process_sampler import ProcessSampler, parse_stat, read_file
from fleetscope.producers.tracers.discovery import TargetSpec
from fleetscope.schema import NODE_TENANT
from fleetscope.streams.features import window_features
from fleetscope.streams.rank_context import RankContext
from fleetscope.streams.windows import WindowAssembler
from support.processes import spawn, wait_until  # noqa: F401 (spawn is a fixture)

SEC = 10**9
# wakes every 20 ms, so a new affinity moves it at once (a sleeping task keeps its old CPU until it runs)
NAP = "import time\nend = time.time() + 60\nwhile time.time() < end: time.sleep(0.02)"


def last_cpu(pid: int) -> int:
    return parse_stat(read_file(f"/proc/{pid}/stat"))[6]


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
