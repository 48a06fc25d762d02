"""Host collectors: exact parsing and delta math on fixture /proc text, then
sanity on this machine's real /proc, then the sampler's batch."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest

from fleetscope import schema, wire
from fleetscope.producers.host.collector import REGISTRY, Collector, Sample, build_collectors
from fleetscope.producers.host.cpu_stat import CpuStatCollector
from fleetscope.producers.host.diskstats import DiskstatsCollector
from fleetscope.producers.host.interrupts import InterruptsCollector
from fleetscope.producers.host.meminfo import MeminfoCollector
from fleetscope.producers.host.netdev import NetdevCollector
from fleetscope.producers.host.numastat import NumastatCollector
from fleetscope.producers.host.sampler import HostSampler
from fleetscope.producers.host.vmstat import VmstatCollector

SEC = 1_000_000_000
TCK = os.sysconf("SC_CLK_TCK")
ALL_NAMES = {"cpu", "meminfo", "vmstat", "interrupts", "netdev", "diskstats", "numastat"}


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def by_key(samples: list[Sample]) -> dict[tuple[str, str], Sample]:
    out = {(s.metric, s.device): s for s in samples}
    assert len(out) == len(samples), "a (metric, device) pair was emitted twice"
    return out


def stat_text(cpus: dict[str, list[int]], ctxt: int, running: int = 3, blocked: int = 1) -> str:
    lines = [f"{name} {' '.join(map(str, vals))}" for name, vals in cpus.items()]
    lines += ["intr 12345 0 0", f"ctxt {ctxt}", "btime 1700000000", "processes 999",
              f"procs_running {running}", f"procs_blocked {blocked}", "softirq 1 2 3"]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------- cpu

CPU0_A = [100, 1, 50, 1000, 10, 2, 3, 4, 0, 0]
CPU1_A = [200, 2, 60, 900, 20, 4, 6, 8, 0, 0]


def total(*rows):
    return [sum(col) for col in zip(*rows)]


def test_cpu_first_call_emits_gauges_only_then_deltas_in_seconds(tmp_path):
    write(tmp_path, "stat", stat_text({"cpu": total(CPU0_A, CPU1_A), "cpu0": CPU0_A, "cpu1": CPU1_A}, ctxt=5000))
    c = CpuStatCollector(proc_root=tmp_path)
    first = by_key(c.collect(10 * SEC))
    assert set(first) == {("cpu.procs_running", "all"), ("cpu.procs_blocked", "all")}
    assert first[("cpu.procs_running", "all")] == Sample("cpu.procs_running", "all", 3.0, 0)

    cpu0_b = [v + d for v, d in zip(CPU0_A, [TCK, 0, TCK // 2, 2 * TCK, 0, 0, 0, TCK, 7, 7])]
    write(tmp_path, "stat", stat_text({"cpu": total(cpu0_b, CPU1_A), "cpu0": cpu0_b, "cpu1": CPU1_A},
                                      ctxt=5600, running=7, blocked=0))
    got = by_key(c.collect(12 * SEC))
    assert got[("cpu.user", "cpu0")] == Sample("cpu.user", "cpu0", 1.0, 2 * SEC)
    assert got[("cpu.system", "cpu0")].value == pytest.approx((TCK // 2) / TCK)
    assert got[("cpu.idle", "cpu0")].value == pytest.approx(2.0)
    assert got[("cpu.steal", "cpu0")].value == pytest.approx(1.0)
    assert got[("cpu.user", "all")].value == pytest.approx(1.0)
    assert got[("cpu.user", "cpu1")].value == 0.0  # unchanged counters still report a zero delta
    assert got[("cpu.context_switches", "all")] == Sample("cpu.context_switches", "all", 600.0, 2 * SEC)
    assert got[("cpu.procs_running", "all")].value == 7.0
    assert got[("cpu.procs_blocked", "all")].value == 0.0
    # guest/guest_nice are already inside user/nice, so they are not emitted.
    assert {m for m, _ in got} == {f"cpu.{f}" for f in ("user", "nice", "system", "idle", "iowait", "irq",
                                                        "softirq", "steal", "context_switches",
                                                        "procs_running", "procs_blocked")}
    assert {d for _, d in got} == {"all", "cpu0", "cpu1"}


def test_cpu_going_offline_and_back_online_skips_that_cpus_delta_for_the_tick(tmp_path):
    c = CpuStatCollector(proc_root=tmp_path)
    write(tmp_path, "stat", stat_text({"cpu": total(CPU0_A, CPU1_A), "cpu0": CPU0_A, "cpu1": CPU1_A}, ctxt=1))
    c.collect(1 * SEC)
    # cpu1 offline: its line vanishes.
    cpu0_b = [v + TCK for v in CPU0_A]
    write(tmp_path, "stat", stat_text({"cpu": total(cpu0_b, CPU1_A), "cpu0": cpu0_b}, ctxt=2))
    devices = {s.device for s in c.collect(2 * SEC) if s.interval_ns}
    assert devices == {"all", "cpu0"}
    # cpu1 back online with its idle counter reset lower: no delta against stale state.
    cpu1_c = [5, 0, 5, 5, 0, 0, 0, 0, 0, 0]
    cpu0_c = [v + TCK for v in cpu0_b]
    write(tmp_path, "stat", stat_text({"cpu": total(cpu0_c, cpu1_c), "cpu0": cpu0_c, "cpu1": cpu1_c}, ctxt=3))
    devices = {s.device for s in c.collect(3 * SEC) if s.interval_ns}
    assert "cpu1" not in devices and "cpu0" in devices
    # Next tick it is back with a delta from its new baseline.
    cpu1_d = [v + TCK for v in cpu1_c]
    write(tmp_path, "stat", stat_text({"cpu": total(cpu0_c, cpu1_d), "cpu0": cpu0_c, "cpu1": cpu1_d}, ctxt=4))
    got = by_key(c.collect(4 * SEC))
    assert got[("cpu.user", "cpu1")] == Sample("cpu.user", "cpu1", 1.0, SEC)


def test_cpu_counter_going_backwards_yields_no_delta_that_tick_then_resumes(tmp_path):
    c = CpuStatCollector(proc_root=tmp_path)
    write(tmp_path, "stat", stat_text({"cpu0": CPU0_A}, ctxt=1000))
    c.collect(1 * SEC)
    back = list(CPU0_A)
    back[4] -= 5  # iowait is known to step backwards on some kernels
    write(tmp_path, "stat", stat_text({"cpu0": back}, ctxt=10))
    got = by_key(c.collect(2 * SEC))
    assert ("cpu.iowait", "cpu0") not in got
    assert ("cpu.context_switches", "all") not in got
    assert got[("cpu.user", "cpu0")].value == 0.0
    after = list(back)
    after[4] += TCK
    write(tmp_path, "stat", stat_text({"cpu0": after}, ctxt=60))
    got = by_key(c.collect(3 * SEC))
    assert got[("cpu.iowait", "cpu0")].value == pytest.approx(1.0)
    assert got[("cpu.context_switches", "all")].value == 50.0


def test_clock_stepping_back_gives_no_deltas_but_keeps_gauges(tmp_path):
    c = CpuStatCollector(proc_root=tmp_path)
    write(tmp_path, "stat", stat_text({"cpu0": CPU0_A}, ctxt=1))
    c.collect(5 * SEC)
    assert all(s.interval_ns == 0 for s in c.collect(4 * SEC))


# ----------------------------------------------------------------- meminfo

MEMINFO = """MemTotal:       24683656 kB
MemFree:        23049636 kB
MemAvailable:   24267172 kB
Buffers:            9740 kB
Cached:          1348808 kB
Dirty:               624 kB
Writeback:             0 kB
AnonPages:          8524 kB
Shmem:              8952 kB
AnonHugePages:      4096 kB
HugePages_Total:      64
HugePages_Free:       60
HugePages_Rsvd:        2
HugePages_Surp:        0
Hugepagesize:       2048 kB
"""


def test_meminfo_reports_bytes_hugepage_counts_and_omits_missing_fields(tmp_path):
    write(tmp_path, "meminfo", MEMINFO)
    c = MeminfoCollector(proc_root=tmp_path)
    got = {k: s.value for k, s in by_key(c.collect(SEC)).items()}
    assert got == {
        ("mem.total", "all"): 24683656 * 1024, ("mem.free", "all"): 23049636 * 1024,
        ("mem.available", "all"): 24267172 * 1024, ("mem.buffers", "all"): 9740 * 1024,
        ("mem.cached", "all"): 1348808 * 1024, ("mem.dirty", "all"): 624 * 1024,
        ("mem.writeback", "all"): 0.0, ("mem.anon", "all"): 8524 * 1024,
        ("mem.anon_huge", "all"): 4096 * 1024, ("mem.hugepages_total", "all"): 64,
        ("mem.hugepages_free", "all"): 60, ("mem.hugepages_rsvd", "all"): 2,
        ("mem.hugepage_size", "all"): 2048 * 1024,
    }  # no ShmemHugePages line -> no mem.shmem_huge
    assert all(s.interval_ns == 0 for s in c.collect(2 * SEC)), "gauges are emitted on every call"


# ------------------------------------------------------------------ vmstat

def test_vmstat_emits_deltas_for_present_counters_only(tmp_path):
    write(tmp_path, "vmstat", "nr_free_pages 5\nnuma_hit 100\nnuma_miss 1\npgfault 1000\npgmajfault 3\n"
                              "thp_fault_alloc 7\npswpin 0\n")
    c = VmstatCollector(proc_root=tmp_path)
    assert c.collect(1 * SEC) == []
    write(tmp_path, "vmstat", "nr_free_pages 9\nnuma_hit 160\nnuma_miss 1\npgfault 1500\npgmajfault 4\n"
                              "thp_fault_alloc 9\npswpin 0\n")
    got = {k: (s.value, s.interval_ns) for k, s in by_key(c.collect(3 * SEC)).items()}
    assert got == {("vm.numa_hit", "all"): (60, 2 * SEC), ("vm.numa_miss", "all"): (0, 2 * SEC),
                   ("vm.pgfault", "all"): (500, 2 * SEC), ("vm.pgmajfault", "all"): (1, 2 * SEC),
                   ("vm.thp_fault_alloc", "all"): (2, 2 * SEC), ("vm.pswpin", "all"): (0, 2 * SEC)}


# -------------------------------------------------------------- interrupts

IRQ_A = """           CPU0       CPU1       CPU2
  0:         10          0          0   IO-APIC   2-edge      timer
 24:          1          5          0  IO-APIC   5-edge      ACPI:Ged
 11:        100        200        300     GICv3  27 Level     arch_timer
NMI:          0          0          0   Non-maskable interrupts
LOC:       1000       2000       3000   Local timer interrupts
ERR:          7
MIS:          0
"""
IRQ_B = """           CPU0       CPU1       CPU2
  0:         10          0          0   IO-APIC   2-edge      timer
 24:          4          5          0  IO-APIC   5-edge      ACPI:Ged
 11:        150        200        300     GICv3  27 Level     arch_timer
NMI:          0          0          0   Non-maskable interrupts
LOC:       1100       2000       3050   Local timer interrupts
ERR:          9
MIS:          0
"""


def test_interrupts_emit_nonzero_cells_per_cpu_totals_and_single_number_rows_as_all(tmp_path):
    write(tmp_path, "interrupts", IRQ_A)
    c = InterruptsCollector(proc_root=tmp_path)
    assert c.collect(1 * SEC) == []
    write(tmp_path, "interrupts", IRQ_B)
    got = {k: s.value for k, s in by_key(c.collect(2 * SEC)).items()}
    assert got == {
        ("irq.count", "24@cpu0"): 3, ("irq.count", "11@cpu0"): 50, ("irq.count", "LOC@cpu0"): 100,
        ("irq.count", "LOC@cpu2"): 50, ("irq.count", "ERR@all"): 2,
        # totals are per CPU over per-CPU rows, emitted even when zero
        ("irq.cpu_total", "cpu0"): 153, ("irq.cpu_total", "cpu1"): 0, ("irq.cpu_total", "cpu2"): 50,
    }


def test_interrupts_follow_the_header_when_a_cpu_goes_offline(tmp_path):
    write(tmp_path, "interrupts", "   CPU0  CPU1  CPU2\nLOC:  10  20  30  Local timer\n")
    c = InterruptsCollector(proc_root=tmp_path)
    c.collect(1 * SEC)
    # CPU1 offline: its column disappears, and CPU2's numbers shift left in the text.
    write(tmp_path, "interrupts", "   CPU0  CPU2\nLOC:  11  35  Local timer\n")
    got = {k: s.value for k, s in by_key(c.collect(2 * SEC)).items()}
    assert got == {("irq.count", "LOC@cpu0"): 1, ("irq.count", "LOC@cpu2"): 5,
                   ("irq.cpu_total", "cpu0"): 1, ("irq.cpu_total", "cpu2"): 5}
    # CPU1 back (its counter reset): no delta for it this tick.
    write(tmp_path, "interrupts", "   CPU0  CPU1  CPU2\nLOC:  12  1  36  Local timer\n")
    got = {k: s.value for k, s in by_key(c.collect(3 * SEC)).items()}
    assert ("irq.cpu_total", "cpu1") not in got and ("irq.count", "LOC@cpu1") not in got
    assert got[("irq.cpu_total", "cpu2")] == 1


def test_interrupts_counter_wrap_and_short_rows_give_no_bogus_delta(tmp_path):
    write(tmp_path, "interrupts", "  CPU0 CPU1 CPU2\nLOC: 4294967290 5 5 timer\nIPI: 3 4\n")
    c = InterruptsCollector(proc_root=tmp_path)
    c.collect(1 * SEC)
    write(tmp_path, "interrupts", "  CPU0 CPU1 CPU2\nLOC: 10 6 5 timer\nIPI: 5 4\n")
    got = {k: s.value for k, s in by_key(c.collect(2 * SEC)).items()}
    # the u32 wrap on cpu0 is skipped; the short IPI row maps onto its first columns
    assert got == {("irq.count", "LOC@cpu1"): 1, ("irq.count", "IPI@cpu0"): 2,
                   ("irq.cpu_total", "cpu0"): 2, ("irq.cpu_total", "cpu1"): 1, ("irq.cpu_total", "cpu2"): 0}


def test_interrupts_on_a_single_cpu_tell_err_rows_from_per_cpu_rows_by_description(tmp_path):
    write(tmp_path, "interrupts", "   CPU0\nLOC: 5 Local timer interrupts\nERR: 1\n")
    c = InterruptsCollector(proc_root=tmp_path)
    c.collect(1 * SEC)
    write(tmp_path, "interrupts", "   CPU0\nLOC: 8 Local timer interrupts\nERR: 2\n")
    got = {k: s.value for k, s in by_key(c.collect(2 * SEC)).items()}
    assert got == {("irq.count", "LOC@cpu0"): 3, ("irq.count", "ERR@all"): 1, ("irq.cpu_total", "cpu0"): 3}


# ------------------------------------------------------------------ netdev

NETDEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo: {lo} 10 0 0 0 0 0 0 {lo} 10 0 0 0 0 0 0
  eth0:{eth} 100 1 2 0 0 0 0 5000 50 3 4 0 0 0 0
"""


def test_netdev_emits_per_interface_deltas_including_lo(tmp_path):
    write(tmp_path, "net/dev", NETDEV.format(lo=1000, eth=123456789))
    c = NetdevCollector(proc_root=tmp_path)
    assert c.collect(1 * SEC) == []
    write(tmp_path, "net/dev", NETDEV.format(lo=1500, eth=123457789).replace(" 100 1 2", " 110 2 2"))
    got = {k: s.value for k, s in by_key(c.collect(2 * SEC)).items()}
    assert got[("net.rx_bytes", "lo")] == 500 and got[("net.tx_bytes", "lo")] == 500
    assert got[("net.rx_bytes", "eth0")] == 1000  # "eth0:123..." glued to the name still parses
    assert got[("net.rx_packets", "eth0")] == 10 and got[("net.rx_errs", "eth0")] == 1
    assert got[("net.rx_drop", "eth0")] == 0 and got[("net.tx_drop", "eth0")] == 0
    assert {m for m, _ in got} == {f"net.{d}_{k}" for d in ("rx", "tx")
                                   for k in ("bytes", "packets", "errs", "drop")}


def test_netdev_interface_created_between_ticks_has_no_delta_until_its_second_tick(tmp_path):
    write(tmp_path, "net/dev", NETDEV.format(lo=1, eth=1).replace("  eth0:1 100 1 2 0 0 0 0 5000 50 3 4 0 0 0 0\n", ""))
    c = NetdevCollector(proc_root=tmp_path)
    c.collect(1 * SEC)
    write(tmp_path, "net/dev", NETDEV.format(lo=1, eth=1))
    assert {d for _, d in by_key(c.collect(2 * SEC))} == {"lo"}


# --------------------------------------------------------------- diskstats

DISK = """   7       0 loop0 {r} 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0
   1       0 ram0 {r} 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0
 253       0 zram0 {r} 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0
 259       0 nvme0n1 {r} 10 {rs} 20 {w} 30 {ws} 40 2 {io} 90 0 0 0 0 0 0
 259       1 nvme0n1p1 {r} 10 {rs} 20 {w} 30 {ws} 40 2 {io} 90
"""


def test_diskstats_skips_virtual_devices_and_reports_bytes_from_512_byte_sectors(tmp_path):
    write(tmp_path, "diskstats", DISK.format(r=100, rs=800, w=50, ws=400, io=1000))
    c = DiskstatsCollector(proc_root=tmp_path)
    assert c.collect(1 * SEC) == []
    write(tmp_path, "diskstats", DISK.format(r=110, rs=808, w=70, ws=440, io=1250))
    got = {k: s.value for k, s in by_key(c.collect(2 * SEC)).items()}
    assert {d for _, d in got} == {"nvme0n1", "nvme0n1p1"}  # 14-field (older kernel) lines parse too
    assert got[("disk.reads", "nvme0n1")] == 10 and got[("disk.writes", "nvme0n1")] == 20
    assert got[("disk.read_bytes", "nvme0n1")] == 8 * 512 and got[("disk.write_bytes", "nvme0n1")] == 40 * 512
    assert got[("disk.io_ms", "nvme0n1")] == 250


def test_diskstats_leaves_out_partitions_so_disk_totals_are_not_doubled(tmp_path):
    write(tmp_path, "sys/class/block/nvme0n1p1/partition", "1\n")  # how sysfs marks a partition
    write(tmp_path, "diskstats", DISK.format(r=100, rs=800, w=50, ws=400, io=1000))
    c = DiskstatsCollector(proc_root=tmp_path, sys_root=tmp_path / "sys")
    c.collect(1 * SEC)
    write(tmp_path, "diskstats", DISK.format(r=110, rs=808, w=70, ws=440, io=1250))
    assert {d for _, d in by_key(c.collect(2 * SEC))} == {"nvme0n1"}


# ---------------------------------------------------------------- numastat

def numastat(hit: int) -> str:
    return (f"numa_hit {hit}\nnuma_miss 2\nnuma_foreign 3\ninterleave_hit 4\n"
            f"local_node {hit}\nother_node 6\n")


def test_numastat_emits_per_node_deltas(tmp_path):
    for n in (0, 1):
        write(tmp_path, f"devices/system/node/node{n}/numastat", numastat(100))
    write(tmp_path, "devices/system/node/online", "0-1\n")  # siblings that are not nodes are ignored
    c = NumastatCollector(sys_root=tmp_path)
    assert c.collect(1 * SEC) == []
    write(tmp_path, "devices/system/node/node1/numastat", numastat(175))
    got = {k: s.value for k, s in by_key(c.collect(2 * SEC)).items()}
    assert got[("numa.numa_hit", "node1")] == 75 and got[("numa.local_node", "node1")] == 75
    assert got[("numa.numa_hit", "node0")] == 0
    assert {m for m, _ in got} == {"numa.numa_hit", "numa.numa_miss", "numa.numa_foreign",
                                   "numa.interleave_hit", "numa.local_node", "numa.other_node"}
    assert {d for _, d in got} == {"node0", "node1"}


@pytest.mark.parametrize("name", sorted(ALL_NAMES))
def test_missing_source_file_returns_empty_and_warns_only_once(name, tmp_path, caplog):
    [c] = build_collectors([name], proc_root=tmp_path, sys_root=tmp_path)
    with caplog.at_level(logging.WARNING):
        assert c.collect(1 * SEC) == []
        assert c.collect(2 * SEC) == []
        assert c.collect(3 * SEC) == []
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert name in warnings[0].getMessage()


def test_malformed_lines_are_skipped_not_fatal(tmp_path):
    write(tmp_path, "stat", "cpu0 1 2 x 4\ncpu1 1 2 3 4 5 6 7 8\nctxt\nprocs_running many\n")
    c = CpuStatCollector(proc_root=tmp_path)
    assert c.collect(1 * SEC) == []
    write(tmp_path, "stat", "cpu0 1 2 x 4\ncpu1 2 2 3 4 5 6 7 8\nctxt\nprocs_running many\n")
    assert {s.device for s in c.collect(2 * SEC)} == {"cpu1"}


# ---------------------------------------------------------------- registry

def test_every_collector_registers_itself_by_name():
    assert ALL_NAMES <= set(REGISTRY)
    assert all(REGISTRY[n].name == n for n in REGISTRY)


def test_build_collectors_defaults_disables_and_keeps_the_requested_order():
    default = {c.name for c in build_collectors()}
    assert default == {n for n, cls in REGISTRY.items() if cls.default_enabled}
    assert "cpu" not in {c.name for c in build_collectors(disabled=["cpu"])}
    assert [c.name for c in build_collectors(["netdev", "cpu", "netdev"])] == ["netdev", "cpu"]


def test_build_collectors_rejects_unknown_names_listing_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown host collector.*'gpu'.*known:.*'cpu'"):
        build_collectors(["cpu", "gpu"])
    with pytest.raises(ValueError, match="nope"):
        build_collectors(disabled=["nope"])


# ----------------------------------------------------------------- sampler

class _Exploding(Collector):
    name = "exploding"

    def collect(self, now_ns):
        raise RuntimeError("boom")


class _Fixed(Collector):
    name = "fixed"

    def __init__(self, samples):
        super().__init__()
        self.samples = samples

    def collect(self, now_ns):
        return list(self.samples)


def test_sampler_counts_a_failing_collector_and_keeps_the_others(caplog):
    fixed = _Fixed([Sample("a.x", "d1", 1.5, 0), Sample("a.y", "d1", 2.0, 7), Sample("a.x", "d2", 3.0, 0)])
    sampler = HostSampler("node-7", [_Exploding(), fixed])
    with caplog.at_level(logging.ERROR):
        batch = sampler.sample(123)
    assert sampler.collector_errors == {"exploding": 1}
    assert "exploding" in caplog.text
    assert list(batch.columns) == list(schema.SOURCE_COLUMNS["host"])
    schema.validate(batch)
    assert (batch.source, batch.host, batch.created_ns, batch.count) == ("host", "node-7", 123, 3)
    assert batch.columns["metric"].values == ("a.x", "a.y")  # dictionary in first-seen order
    assert batch.columns["metric"].codes.tolist() == [0, 1, 0]
    assert batch.columns["device"].to_numpy().tolist() == ["d1", "d1", "d2"]
    assert batch.columns["value"].tolist() == [1.5, 2.0, 3.0]
    assert batch.columns["interval_ns"].tolist() == [0, 7, 0]
    assert batch.columns["ts_ns"].tolist() == [123] * 3
    assert batch.columns["job"].to_numpy().tolist() == ["node-7"] * 3
    sampler.sample(124)
    assert sampler.collector_errors == {"exploding": 2}


def test_sampler_returns_none_when_no_collector_has_samples():
    assert HostSampler("h", [_Fixed([])]).sample(1) is None


# ------------------------------------------------------ this machine's /proc

def test_real_cpu_deltas_account_for_elapsed_time_on_every_cpu():
    c = CpuStatCollector()
    t0 = time.time_ns()
    c.collect(t0)
    end = time.monotonic() + 0.2
    while time.monotonic() < end:  # keep one CPU busy so user time must move
        pass
    samples = c.collect(time.time_ns())
    deltas = [s for s in samples if s.interval_ns > 0 and s.metric != "cpu.context_switches"]
    elapsed = deltas[0].interval_ns / SEC
    per_cpu = [s for s in deltas if s.device != "all"]
    ncpu = len({s.device for s in per_cpu})
    assert ncpu >= 1
    # /proc/stat ticks are 1/CLK_TCK s, and each of 8 fields per CPU may round.
    slack = 0.15 * elapsed * ncpu + 2 * ncpu / TCK
    assert sum(s.value for s in per_cpu) == pytest.approx(elapsed * ncpu, abs=slack)
    whole = {s.metric: s.value for s in deltas if s.device == "all"}
    assert sum(whole.values()) == pytest.approx(elapsed * ncpu, abs=slack)
    busy = sum(v for m, v in whole.items() if m not in ("cpu.idle", "cpu.iowait"))
    assert 0.0 <= busy / sum(whole.values()) <= 1.0
    assert whole["cpu.user"] + whole["cpu.system"] >= 0.05  # our 0.2 s loop is visible
    assert all(s.value >= 0 for s in samples)


def test_real_host_sampler_batch_validates_and_survives_the_wire():
    sampler = HostSampler("this-host", build_collectors())
    first = sampler.sample()
    assert first is not None and first.count > 0  # meminfo gauges exist from the first tick
    time.sleep(0.05)
    batch = sampler.sample()
    assert sampler.collector_errors == {}
    schema.validate(batch)
    metrics = set(batch.columns["metric"].values)
    assert {"cpu.user", "net.rx_bytes", "cpu.procs_running"} <= metrics
    # meminfo runs once a second (Collector.cadence_ns): in the first batch, not in one 50 ms later.
    assert "mem.total" in set(first.columns["metric"].values) and "mem.total" not in metrics
    assert len(batch.columns["metric"].values) == len(metrics), "dictionary has no duplicates"
    back = wire.decode(wire.encode(batch), batch.kafka_headers())
    schema.validate(back)
    assert (back.source, back.host, back.batch_id, back.created_ns) == ("host", "this-host", batch.batch_id,
                                                                       batch.created_ns)
    for name, col in batch.columns.items():
        if isinstance(col, wire.StrColumn):
            assert back.columns[name].to_numpy().tolist() == col.to_numpy().tolist()
        else:
            np.testing.assert_array_equal(back.columns[name], col)
    intervals = batch.columns["interval_ns"]
    assert set(np.unique(intervals)) <= {0, int(intervals.max())}  # one interval per tick
    assert (batch.columns["value"][intervals > 0] >= 0).all()


# ------------------------------------------------- fast paths (cost work)

def test_read_text_reads_a_file_larger_than_one_read_chunk(tmp_path):
    from fleetscope.producers.host import collector as collector_module
    text = "".join(f"line {i}\n" for i in range(3 * collector_module._READ_CHUNK // 8))
    write(tmp_path, "big", text)
    assert len(text) > 2 * collector_module._READ_CHUNK
    assert VmstatCollector(proc_root=tmp_path).read_text(str(tmp_path / "big")) == text


def test_vmstat_and_meminfo_take_only_well_formed_wanted_lines(tmp_path):
    write(tmp_path, "vmstat", "pgfault 5\npgfault_extra 7\n  numa_hit 8 \npgmajfault 1 2\nnuma_miss x\n"
                              "pswpin 3\npswpout")
    c = VmstatCollector(proc_root=tmp_path)
    c.collect(1 * SEC)
    write(tmp_path, "vmstat", "pgfault 9\npgfault_extra 70\n  numa_hit 10 \npgmajfault 5 6\nnuma_miss y\n"
                              "pswpin 4\npswpout")
    got = {k: s.value for k, s in by_key(c.collect(2 * SEC)).items()}
    assert got == {("vm.pgfault", "all"): 4.0, ("vm.numa_hit", "all"): 2.0, ("vm.pswpin", "all"): 1.0}
    write(tmp_path, "meminfo", " MemTotal :  5 kB\nMemFree:\nCached: x kB\nDirty: 7\nBuffers:1 KB extra\n"
                               "Writeback: 2 MB\nMemAvailableX: 3 kB\n")
    got = {k: s.value for k, s in by_key(MeminfoCollector(proc_root=tmp_path).collect(SEC)).items()}
    assert got == {("mem.total", "all"): 5 * 1024, ("mem.dirty", "all"): 7.0, ("mem.buffers", "all"): 1024.0,
                   ("mem.writeback", "all"): 2.0}


def test_interrupts_same_layout_fast_path_matches_the_aligned_path(tmp_path):
    # Same rows and columns on both ticks (the fast path), with a backwards counter.
    write(tmp_path, "interrupts", "  CPU0 CPU1\nA: 1 2 x\nB: 10 20 y\nS: 5\nT: 1\n")
    c = InterruptsCollector(proc_root=tmp_path)
    c.collect(1 * SEC)
    write(tmp_path, "interrupts", "  CPU0 CPU1\nA: 4 2 x\nB: 9 25 y\nS: 7\nT: 3\n")
    samples = c.collect(2 * SEC)
    assert all(type(s) is Sample and s.interval_ns == SEC for s in samples)
    got = {k: s.value for k, s in by_key(samples).items()}
    # S and T are machine-wide rows (one number, two CPUs).
    assert got == {("irq.count", "A@cpu0"): 3.0, ("irq.count", "B@cpu1"): 5.0, ("irq.count", "S@all"): 2.0,
                   ("irq.count", "T@all"): 2.0, ("irq.cpu_total", "cpu0"): 3.0, ("irq.cpu_total", "cpu1"): 5.0}
    write(tmp_path, "interrupts", "  CPU0 CPU1\nA: 4 2 x\nB: 9 25 y\nS: 7\nT: 3\n")
    assert {k for k, s in by_key(c.collect(3 * SEC)).items() if s.value} == set()


def test_diskstats_asks_sysfs_again_about_a_device_that_left_and_came_back(tmp_path):
    line = "259 {minor} {name} {r} 0 8 0 5 0 40 0 0 100 200\n"
    write(tmp_path, "diskstats", line.format(minor=0, name="sdx", r=1))
    c = DiskstatsCollector(proc_root=tmp_path, sys_root=tmp_path / "sys")
    c.collect(1 * SEC)
    write(tmp_path, "diskstats", line.format(minor=0, name="sdx", r=2))
    assert {d for _, d in by_key(c.collect(2 * SEC))} == {"sdx"}
    write(tmp_path, "diskstats", "")  # gone ...
    c.collect(3 * SEC)
    write(tmp_path, "sys/class/block/sdx/partition", "1\n")  # ... and back as a partition
    write(tmp_path, "diskstats", line.format(minor=1, name="sdx", r=3))
    c.collect(4 * SEC)
    write(tmp_path, "diskstats", line.format(minor=1, name="sdx", r=4))
    assert c.collect(5 * SEC) == []


def test_sampler_columns_match_the_samples_row_for_row():
    rows = [Sample("m.a", "d2", 1.0, 5), Sample("m.b", "d1", -2.5, 5), Sample("m.a", "d1", 3.0, 0),
            Sample("m.c", "d2", 4.0, 5)]
    batch = HostSampler("h", [_Fixed(rows)]).sample(9)
    cols = batch.columns
    assert list(zip(cols["metric"].to_numpy().tolist(), cols["device"].to_numpy().tolist(),
                    cols["value"].tolist(), cols["interval_ns"].tolist())) == [tuple(r) for r in rows]
    assert cols["metric"].values == ("m.a", "m.b", "m.c") and cols["device"].values == ("d2", "d1")
    assert cols["metric"].codes.dtype == np.uint32 and cols["value"].dtype == np.dtype("<f8")
    assert cols["interval_ns"].dtype == np.dtype("<i8")


def test_procfs_files_stay_open_and_read_fresh_but_other_trees_are_reopened(tmp_path):
    c = CpuStatCollector()
    first = c.read_text("/proc/stat")
    assert "/proc/stat" in c._fds
    time.sleep(0.02)
    second = c.read_text("/proc/stat")
    ctxt = [int(t.split("\nctxt ")[1].split()[0]) for t in (first, second)]
    assert ctxt[1] > ctxt[0]  # the kept descriptor gives the kernel's current numbers
    c.close()
    assert c._fds == {}
    write(tmp_path, "stat", "")
    t = CpuStatCollector(proc_root=tmp_path)
    assert t.read_text(str(tmp_path / "stat")) == "" and t._fds == {}
    (tmp_path / "stat").unlink()
    write(tmp_path, "stat", "ctxt 5\n")  # a new file under the same name is what gets read
    assert t.read_text(str(tmp_path / "stat")) == "ctxt 5\n"


def test_interrupts_python_and_numpy_delta_paths_agree(tmp_path, monkeypatch):
    import fleetscope.producers.host.interrupts as interrupts_module
    first = "  CPU0 CPU1 CPU2\nA: 1 2 3 x\nB: 10 20 30 y\nC: 7 7 7 z\nS: 4 5\nT: 1\n"
    second = "  CPU0 CPU1 CPU2\nA: 4 2 1 x\nB: 10 25 31 y\nC: 7 7 7 z\nS: 6 5\nT: 3\n"
    results = []
    for cells in (0, 4096):
        monkeypatch.setattr(interrupts_module, "_PY_CELLS", cells)
        write(tmp_path, "interrupts", first)
        c = InterruptsCollector(proc_root=tmp_path)
        c.collect(1 * SEC)
        write(tmp_path, "interrupts", second)
        results.append(c.collect(2 * SEC))
    assert results[0] == results[1]
    assert [(s.metric, s.device, s.value) for s in results[0]] == [
        ("irq.count", "A@cpu0", 3.0), ("irq.count", "B@cpu1", 5.0), ("irq.count", "B@cpu2", 1.0),
        ("irq.count", "S@cpu0", 2.0), ("irq.cpu_total", "cpu0", 5.0), ("irq.cpu_total", "cpu1", 5.0),
        ("irq.cpu_total", "cpu2", 1.0), ("irq.count", "T@all", 2.0)]


def test_slow_collectors_run_on_their_cadence_and_their_deltas_cover_it(tmp_path):
    write(tmp_path, "vmstat", "pgfault 100\n")
    write(tmp_path, "stat", stat_text({"cpu": CPU0_A}, ctxt=5000))
    sampler = HostSampler("h", [CpuStatCollector(proc_root=tmp_path), VmstatCollector(proc_root=tmp_path)])
    assert VmstatCollector.cadence_ns == SEC and CpuStatCollector.cadence_ns == 0
    runs = []
    for i in range(12):  # a 100 ms tick, with a little jitter
        write(tmp_path, "vmstat", f"pgfault {100 + 10 * i}\n")
        batch = sampler.sample(SEC + i * SEC // 10 - (SEC // 1000 if i == 10 else 0))
        rows = list(zip(batch.columns["metric"].to_numpy().tolist(), batch.columns["value"].tolist(),
                        batch.columns["interval_ns"].tolist()))
        runs.append([r for r in rows if r[0] == "vm.pgfault"])
        assert any(r[0] == "cpu.procs_running" for r in rows)  # the per-tick collector runs every tick
    assert [bool(r) for r in runs] == [False] * 10 + [True, False]
    assert runs[10] == [("vm.pgfault", 100.0, SEC - SEC // 1000)]  # 10 ticks of faults, over the real interval
    every_tick = HostSampler("h", [VmstatCollector(proc_root=tmp_path)], use_cadence=False)
    every_tick.sample(SEC)
    write(tmp_path, "vmstat", "pgfault 999\n")
    assert every_tick.sample(SEC + SEC // 10).count == 1
