"""The feature catalogue (streams/feature_catalogue.py) against what the builders really emit:
a rank window and a node window, each fed every metric its sources send, through the real
WindowAssembler and window_features. Every name emitted must be catalogued for that kind of
window, and every catalogued name must be emitted."""
from __future__ import annotations

import numpy as np

from fleetscope.schema import NODE_TENANT, SOURCE_COLUMNS, validate
from fleetscope.streams.feature_catalogue import NODE_FEATURES, RANK_FEATURES
from fleetscope.streams.features import window_features
from fleetscope.streams.trace_features import COLLECTIVES, LAUNCH_APIS, MEMCPY_APIS, SYNC_APIS
from fleetscope.streams.windows import WindowAssembler
from fleetscope.wire import Batch, StrColumn

T0 = 1_700_000_000 * 10**9
TICK = 250_000_000
CPU_STATES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")

RANK_ROWS = {   # source -> (metric, device, value, interval_ns): every metric the builders read
    "cuda": [("cuda.calls", LAUNCH_APIS[0], 100, TICK), ("cuda.dur_ns", SYNC_APIS[0], 1e6, TICK),
             ("cuda.dur_ns", MEMCPY_APIS[0], 1e6, TICK), ("cuda.memcpy_bytes", "HtoD", 1e6, TICK),
             ("cuda.lat_p50_ns", MEMCPY_APIS[0], 1e3, 0), ("cuda.lat_p99_ns", MEMCPY_APIS[0], 1e4, 0),
             ("cuda.mem_live_bytes", "all", 1e9, 0), ("cuda.pinned_live_bytes", "all", 1e6, 0),
             ("cuda.malloc_bytes", "cudaMalloc", 1e6, TICK),
             ("cuda.free_bytes", "cudaFree", 1e5, TICK), ("cuda.errors", "cudaMemcpy", 0, TICK),
             ("cuda.nccl_sync_wait_ns", "all", 1e6, TICK)],
    "nccl": [row for op in COLLECTIVES for row in (
        ("nccl.calls", op, 5, TICK), ("nccl.bytes", op, 1e6, TICK), ("nccl.dur_ns", op, 1e6, TICK),
        ("nccl.lat_p50_ns", op, 1e5, 0), ("nccl.lat_p99_ns", op, 2e5, 0))],
    "python": [("python.gc_ns", "all", 1e5, TICK), ("python.gc_count", "all", 2, TICK),
               ("python.calls", "f", 100, TICK), ("python.func_ns", "f", 1e7, TICK)],
    # py-spy's sampled stacks: the top function's id (streams/stack_signature.py)
    "python_sampler": [("python.samples", "all", 40, TICK), ("python.stack_top", "train:step", 1.0, 0)],
    "torch": [("torch.ops", "aten::mm", 10, TICK), ("torch.ops", "aten::relu", 10, TICK),
              ("torch.ops", "aten::cat", 10, TICK), ("torch.op_ns", "all", 1e6, TICK),
              ("torch.comm_wait_ns", "recv", 1e6, TICK), ("torch.comm_wait_calls", "recv", 3, TICK),
              ("torch.comm_wait_ns", "work", 1e6, TICK), ("torch.coll_issued", "gloo0", 2, TICK)],
    "kernel": [(m, "all", 1e6, TICK) for m in ("kernel.offcpu_ns", "kernel.runq_wait_ns", "kernel.ctx_switches",
                                              "kernel.tcp_retransmits", "kernel.irq_count")]
              + [("kernel.process_exit", "signal:SIGKILL", 1, TICK)],   # a crashed process (exit_features)
    "proc": [(m, "pid77", 1e6, TICK) for m in ("proc.cpu_ns", "proc.majflt", "proc.minflt", "proc.vol_ctx",
                                             "proc.invol_ctx", "proc.read_bytes", "proc.write_bytes")]
            + [("proc.rss_bytes", "pid77", 1e9, 0), ("proc.threads", "pid77", 8, 0)],
    "nvml": [("nvml.proc_energy_j", "0", 10, TICK), ("nvml.proc_sm_util", "0", 50, 0),
             ("nvml.proc_mem_used", "0", 1e9, 0)],
}
NODE_ROWS = {
    "host": [(f"cpu.{s}", "all", 0.1, TICK) for s in CPU_STATES] + [(f"cpu.{s}", "cpu0", 0.1, TICK) for s in CPU_STATES]
            + [(m, "all", v, 0) for m, v in (("mem.total", 100), ("mem.available", 50), ("mem.anon", 10),
                                             ("mem.anon_huge", 5), ("mem.hugepages_total", 4), ("mem.hugepages_free", 2))]
            + [(m, "all", 10, TICK) for m in ("vm.numa_hit", "vm.numa_miss", "vm.pgfault", "vm.pgmajfault",
                                             "cpu.context_switches")]
            + [(m, "eth0", 10, TICK) for m in ("irq.cpu_total", "net.rx_bytes", "net.tx_bytes", "disk.read_bytes",
                                              "disk.write_bytes")],
    "agent": [(f"agent.{s}", "all", 0, 0) for s in ("dropped_events", "delivery_errors", "spooled")],
    "nvml": [("nvml.energy_j", "0", 100, TICK)]
            + [(m, "0", 50, 0) for m in ("nvml.gpu_util", "nvml.power_w", "nvml.ofu", "nvml.gpm.tensor_util",
                                         "nvml.throttle.sw_power_cap")]
            # the sampler's temperature, clock and ECC gauges, and the XidWatcher's event rows (device gpu<N>)
            + [(m, "gpu0", 1, 0) for m in ("nvml.temp_c", "nvml.sm_clock_mhz", "nvml.xid", "nvml.event.dbe_ecc",
                                           "nvml.ecc.uncorrected_volatile", "nvml.remapped_rows.pending")],
    # the kernel tracer's node-wide rows: retransmits and hard IRQs per CPU
    "kernel": [("kernel.tcp_retransmits", "10.0.0.1:1->10.0.0.2:2", 1, TICK), ("kernel.irq_count", "cpu0", 30, TICK),
               ("kernel.irq_count", "cpu1", 10, TICK)],
}


def batch(source: str, ts: int, rows, node: bool) -> Batch:
    n = len(rows)
    metric, device, value, interval = zip(*rows)
    cols = {"ts_ns": np.full(n, ts, "<i8"), "tenant": StrColumn.constant(NODE_TENANT if node else "t", n),
            "job": StrColumn.constant("node-a" if node else "j", n), "rank": np.full(n, -1 if node else 3, "<i4"),
            "pid": np.full(n, 0 if node else 77, "<i4"), "gpu": np.full(n, -1 if node else 0, "<i2"),
            "metric": StrColumn.of(metric), "device": StrColumn.of(device), "value": np.array(value, "<f8"),
            "interval_ns": np.array(interval, "<i8"), "sample_frac": np.ones(n, "<f8")}
    b = Batch(source, "node-a", {k: cols[k] for k in SOURCE_COLUMNS[source]}, created_ns=ts)
    validate(b)
    return b


def features_of(rows_by_source, node: bool) -> dict[str, float]:
    w = WindowAssembler(window_s=1.0, allowed_lateness_s=0, idle_close_s=60)
    for i in range(4):
        for source, rows in rows_by_source.items():
            w.add(batch(source, T0 + (i + 1) * TICK - 1, rows, node), None)
    (window,) = [x for x in w.pop_closed(force=True) if x.start_ns == T0]
    return window_features(window)


def test_a_rank_window_emits_exactly_the_catalogued_rank_features():
    assert set(features_of(RANK_ROWS, node=False)) == RANK_FEATURES


def test_a_node_window_emits_exactly_the_catalogued_node_features():
    assert set(features_of(NODE_ROWS, node=True)) == NODE_FEATURES
