"""Window features from traced sources: rates, time shares, percentiles, and sample_frac scaling."""
from __future__ import annotations

import numpy as np
import pytest

from fleetscope.schema import SOURCE_COLUMNS, validate
from fleetscope.wire import Batch, StrColumn
from fleetscope.streams.features import window_features
from fleetscope.streams.windows import WindowAssembler

T0 = 1_700_000_000 * 10**9
TICK = 250_000_000  # the agent samples every 250 ms here


def traced_batch(source: str, ts: int, rows: list[tuple[str, str, float, int]], frac: float = 1.0) -> Batch:
    """rows: (metric, device, value, interval_ns) of one rank (tenant t, job j, rank 3, pid 77)."""
    n = len(rows)
    metric, device, value, interval = zip(*rows)
    cols = {"ts_ns": np.full(n, ts, "<i8"), "tenant": StrColumn.constant("t", n), "job": StrColumn.constant("j", n),
            "rank": np.full(n, 3, "<i4"), "pid": np.full(n, 77, "<i4"), "gpu": np.full(n, 0, "<i2"),
            "metric": StrColumn.of(metric), "device": StrColumn.of(device), "value": np.array(value, "<f8"),
            "interval_ns": np.array(interval, "<i8"), "sample_frac": np.full(n, frac, "<f8")}
    batch = Batch(source, "node-a", {k: cols[k] for k in SOURCE_COLUMNS[source]}, created_ns=ts)
    validate(batch)
    return batch


def one_window(batches) -> dict[str, float]:
    w = WindowAssembler(window_s=1.0, allowed_lateness_s=0, idle_close_s=60)
    for b in batches:
        w.add(b, None)
    (window,) = [x for x in w.pop_closed(force=True) if x.start_ns == T0]
    return window_features(window)


def test_cuda_rates_shares_percentiles_and_leak_balance():
    batches = []
    for i in range(4):  # four 250 ms ticks fill the window [T0, T0+1s)
        ts = T0 + (i + 1) * TICK - 1
        batches.append(traced_batch("cuda", ts, [
            ("cuda.calls", "cudaLaunchKernel", 1000, TICK),
            ("cuda.calls", "cudaStreamSynchronize", 10, TICK), ("cuda.dur_ns", "cudaStreamSynchronize", 50e6, TICK),
            ("cuda.dur_ns", "cudaMemcpy", 25e6, TICK), ("cuda.memcpy_bytes", "HtoD", 4e6, TICK),
            ("cuda.memcpy_bytes", "DtoH", 1e6, TICK),
            ("cuda.lat_p50_ns", "cudaMemcpy", 1000 * (i + 1), 0), ("cuda.lat_p99_ns", "cudaMemcpy", 9000 * (i + 1), 0),
            ("cuda.malloc_bytes", "cudaMalloc", 1 << 20, TICK), ("cuda.free_bytes", "cudaFree", 1 << 18, TICK),
            ("cuda.mem_live_bytes", "all", (i + 1) * 3 * (1 << 18), 0), ("cuda.errors", "cudaMemcpy", 0, TICK)]))
    f = one_window(batches)
    assert f["cuda_launch_per_s"] == pytest.approx(4000)
    assert f["cuda_sync_frac"] == pytest.approx(0.2)
    assert f["cuda_memcpy_frac"] == pytest.approx(0.1)
    assert f["cuda_memcpy_bytes_per_s"] == pytest.approx(20e6)
    assert f["cuda_memcpy_htod_bytes_per_s"] == pytest.approx(16e6)
    assert f["cuda_memcpy_lat_p50_ns"] == pytest.approx(2500)  # mean of the ticks' p50
    assert f["cuda_memcpy_lat_p99_ns"] == pytest.approx(36000)  # the worst tick's p99
    assert f["cuda_malloc_free_balance_bytes"] == pytest.approx(4 * ((1 << 20) - (1 << 18)))
    assert f["cuda_mem_live_bytes"] == pytest.approx(12 * (1 << 18))  # the newest gauge
    assert f["cuda_errors_per_s"] == 0.0  # a measured zero, present
    assert "nccl_calls_per_s" not in f  # no NCCL source: masked, not zero


def test_duty_cycled_counts_scale_by_sample_frac_so_rates_do_not_jump():
    full = one_window([traced_batch("torch", T0 + (i + 1) * TICK - 1, [("torch.ops", "aten::mm", 400, TICK)])
                       for i in range(4)])
    # the governor attached the family a quarter of the time: a quarter of the hits, same estimate
    sampled = one_window([traced_batch("torch", T0 + (i + 1) * TICK - 1, [("torch.ops", "aten::mm", 100, TICK)],
                                       frac=0.25) for i in range(4)])
    assert full["torch_ops_per_s"] == pytest.approx(1600)
    assert sampled["torch_ops_per_s"] == pytest.approx(full["torch_ops_per_s"])
    assert sampled["torch_matmul_ops_per_s"] == pytest.approx(1600)


def test_nccl_bandwidth_per_collective_and_python_gc_share():
    f = one_window([
        traced_batch("nccl", T0 + TICK, [("nccl.calls", "AllReduce", 8, TICK), ("nccl.bytes", "AllReduce", 8e9, TICK),
                                         ("nccl.dur_ns", "AllReduce", 400e6, TICK),
                                         ("nccl.lat_p99_ns", "AllReduce", 60e6, 0)]),
        traced_batch("python", T0 + TICK, [("python.gc_ns", "all", 150e6, TICK), ("python.gc_count", "all", 30, TICK),
                                           ("python.calls", "train:step", 5, TICK),
                                           ("python.func_ns", "train:step", 900e6, TICK)])])
    assert f["nccl_algbw_gbps"] == pytest.approx(20.0)
    assert f["nccl_allreduce_algbw_gbps"] == pytest.approx(20.0)
    assert f["nccl_allreduce_lat_p99_ns"] == pytest.approx(60e6)
    assert f["nccl_time_frac"] == pytest.approx(0.4)
    assert f["python_gc_frac"] == pytest.approx(0.15)
    assert f["python_gc_per_s"] == pytest.approx(30)
    assert f["python_top_func_share"] == pytest.approx(0.9)


def test_torch_collective_waits_are_shares_and_rates_and_masked_without_the_probes():
    ticks = [traced_batch("torch", T0 + (i + 1) * TICK - 1, [
        ("torch.comm_wait_calls", "recv", 8, TICK), ("torch.comm_wait_ns", "recv", 150e6, TICK),
        ("torch.comm_wait_calls", "send", 8, TICK), ("torch.comm_wait_ns", "send", 50e6, TICK),
        ("torch.comm_wait_calls", "work", 1, TICK), ("torch.comm_wait_ns", "work", 225e6, TICK),
        ("torch.comm_wait_max_ns", "recv", 40e6, 0)]) for i in range(4)]
    f = one_window(ticks)
    assert f["torch_comm_wait_frac"] == pytest.approx(0.8)  # 4 x 200 ms of recv+send waits in 1 s
    assert f["torch_work_wait_frac"] == pytest.approx(0.9)
    assert f["torch_comm_waits_per_s"] == pytest.approx(64)
    assert "torch_ops_per_s" not in f  # the ops family sat this window out: masked, the waits still count

    # attached, and no collective ran: the tracer's measured zeros give 0, present
    idle = one_window([traced_batch("torch", T0 + TICK, [
        ("torch.comm_wait_calls", k, 0, TICK) for k in ("recv", "send", "work")] + [
        ("torch.comm_wait_ns", k, 0, TICK) for k in ("recv", "send", "work")])])
    assert idle["torch_comm_wait_frac"] == 0.0 and idle["torch_work_wait_frac"] == 0.0
    assert idle["torch_comm_waits_per_s"] == 0.0

    # no libtorch_cpu / no gloo symbols: only op rows arrive, and the wait features are absent, not 0
    ops_only = one_window([traced_batch("torch", T0 + TICK, [("torch.ops", "linear", 100, TICK),
                                                             ("torch.op_ns", "linear", 1e6, TICK)])])
    assert ops_only["torch_ops_per_s"] == pytest.approx(100)
    assert not {"torch_comm_wait_frac", "torch_work_wait_frac", "torch_comm_waits_per_s"} & set(ops_only)
    # c10d without gloo: Work::wait alone
    work_only = one_window([traced_batch("torch", T0 + TICK, [("torch.comm_wait_calls", "work", 2, TICK),
                                                              ("torch.comm_wait_ns", "work", 1e8, TICK)])])
    assert work_only["torch_work_wait_frac"] == pytest.approx(0.1)
    assert "torch_comm_wait_frac" not in work_only and "torch_comm_waits_per_s" not in work_only


def test_pinned_host_memory_is_its_own_feature_apart_from_device_memory():
    batches = [traced_batch("cuda", T0 + (i + 1) * TICK - 1, [
        ("cuda.mem_live_bytes", "all", 1 << 30, 0), ("cuda.pinned_live_bytes", "all", (i + 1) * (1 << 20), 0)])
        for i in range(4)]
    f = one_window(batches)
    assert f["cuda_pinned_live_bytes"] == 4 * (1 << 20)  # the newest gauge
    assert f["cuda_mem_live_bytes"] == 1 << 30           # device memory does not include it
    assert "cuda_pinned_live_bytes" not in one_window([traced_batch("cuda", T0 + TICK - 1, [
        ("cuda.mem_live_bytes", "all", 1, 0)])])        # no pinned rows: masked


def sampler_rows(i: int) -> list:
    """py-spy's rows of one sampler window: the innermost frames' shares of its samples."""
    return [("python.samples", "all", 200, TICK), ("python.sample_self_share", "train.py:step", 0.5 + 0.1 * i, 0),
            ("python.sample_self_share", "loader.py:next", 0.3, 0), ("python.sample_share", "train.py:main", 1.0, 0)]


def test_python_top_func_share_comes_from_samples_when_no_usdt_probes_report():
    f = one_window([traced_batch("python_sampler", T0 + (i + 1) * TICK - 1, sampler_rows(i)) for i in range(2)])
    # the top function by own (innermost-frame) share, mean over the sampler's windows: (0.5 + 0.6) / 2;
    # the inclusive share (1.0 for main) is not an own share
    assert f["python_top_func_share"] == pytest.approx(0.55)
    assert "python_calls_per_s" not in f and "python_gc_frac" not in f  # samples say nothing of calls or GC


def test_usdt_python_features_win_over_samples_when_both_report():
    usdt = [("python.calls", "f", 100, TICK), ("python.func_ns", "f", 0.1e9, TICK)]
    batches = [traced_batch("python", T0 + (i + 1) * TICK - 1, usdt) for i in range(4)]
    batches += [traced_batch("python_sampler", T0 + TICK - 1, sampler_rows(0))]
    f = one_window(batches)
    assert f["python_top_func_share"] == pytest.approx(0.4)  # 4 x 0.1 s of f in the 1 s window, not 0.5
