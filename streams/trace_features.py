"""Features from the uprobe/USDT tracers: CUDA, NCCL, Python and PyTorch.

Delta rows from duty-cycled probe families arrive already scaled by
1/sample_frac (see WindowAssembler.add), so rates do not jump when the
governor changes a duty cycle. Time shares ("fraction of the window spent in
sync calls") divide summed call time by the window's length; with several
threads or processes per rank they can exceed 1 (threads, on average).
Latency percentiles are the worst interval's percentile inside the window:
a gauge per tick, so the window keeps its maximum p99 and its mean p50.
"""
from __future__ import annotations

from functools import lru_cache

from fleetscope.streams.windows import MetricAgg, Window

SYNC_APIS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize")
MEMCPY_APIS = ("cudaMemcpy", "cudaMemcpyAsync")
LAUNCH_APIS = ("cudaLaunchKernel", "cudaLaunchCooperativeKernel", "cudaGraphLaunch", "cuLaunchKernel", "cuLaunchKernelEx")
# gloo's transport waits for peers' data (torch.comm_wait_* devices); "work" is c10d's Work::wait, the caller's
COMM_WAITS = ("recv", "send")
COLLECTIVES = ("AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce", "Send", "Recv")
# torch op classes by name fragment (first match wins)
TORCH_CLASSES = (("matmul", ("mm", "matmul", "linear", "addmm", "bmm", "conv", "einsum", "baddbmm")),
                 ("elementwise", ("relu", "add", "mul", "sub", "div", "gelu", "sigmoid", "tanh", "silu", "softmax",
                                  "dropout", "exp", "sqrt", "neg", "pow", "where", "clamp")))


def _window_s(w: Window) -> float:
    return (w.end_ns - w.start_ns) / 1e9


def _devices(w: Window, source: str, metric: str, devices) -> tuple[MetricAgg, ...] | list[MetricAgg]:
    """The metric's devices in the window, or those named in `devices` (a device appears once per metric)."""
    if devices is None:
        return w.devices(source, metric)
    if len(devices) == 1:
        found = w.agg(source, metric, devices[0])
        return () if found is None else (found,)
    return [a for a in w.devices(source, metric) if a.device in devices]


def _deltas(w: Window, source: str, metric: str, devices=None) -> list[MetricAgg]:
    return [a for a in _devices(w, source, metric, devices) if a.interval_ns > 0]


def _total(aggs) -> float | None:
    return sum(a.delta_sum for a in aggs) if aggs else None


def _sum(w: Window, source: str, metric: str, devices=None) -> float | None:
    return _total(_deltas(w, source, metric, devices))


def _gauges(w: Window, source: str, metric: str, devices=None) -> list[MetricAgg]:
    return [a for a in _devices(w, source, metric, devices) if a.gauge_n]


def _put(out: dict, name: str, value: float | None) -> None:
    if value is not None:
        out[name] = float(value)


def cuda_features(w: Window) -> dict[str, float]:
    if "cuda" not in w.sources:
        return {}
    out: dict[str, float] = {}
    span = _window_s(w)
    launches = _sum(w, "cuda", "cuda.calls", LAUNCH_APIS)
    _put(out, "cuda_launch_per_s", None if launches is None else launches / span)
    sync_ns = _sum(w, "cuda", "cuda.dur_ns", SYNC_APIS)
    _put(out, "cuda_sync_frac", None if sync_ns is None else sync_ns / 1e9 / span)
    copy_ns = _sum(w, "cuda", "cuda.dur_ns", MEMCPY_APIS)
    _put(out, "cuda_memcpy_frac", None if copy_ns is None else copy_ns / 1e9 / span)
    copied = _sum(w, "cuda", "cuda.memcpy_bytes")
    _put(out, "cuda_memcpy_bytes_per_s", None if copied is None else copied / span)
    htod = _sum(w, "cuda", "cuda.memcpy_bytes", ("HtoD",))
    _put(out, "cuda_memcpy_htod_bytes_per_s", None if htod is None else htod / span)
    p50 = _gauges(w, "cuda", "cuda.lat_p50_ns", MEMCPY_APIS)
    if p50:
        out["cuda_memcpy_lat_p50_ns"] = sum(a.gauge_sum for a in p50) / sum(a.gauge_n for a in p50)
    p99 = _gauges(w, "cuda", "cuda.lat_p99_ns", MEMCPY_APIS)
    if p99:
        out["cuda_memcpy_lat_p99_ns"] = max(a.gauge_last for a in p99)
    live = _gauges(w, "cuda", "cuda.mem_live_bytes")
    if live:
        out["cuda_mem_live_bytes"] = sum(a.gauge_last for a in live)
    pinned = _gauges(w, "cuda", "cuda.pinned_live_bytes")  # page-locked host RAM, apart from device memory
    if pinned:
        out["cuda_pinned_live_bytes"] = sum(a.gauge_last for a in pinned)
    malloc, free = _sum(w, "cuda", "cuda.malloc_bytes"), _sum(w, "cuda", "cuda.free_bytes")
    if malloc is not None or free is not None:
        out["cuda_malloc_free_balance_bytes"] = (malloc or 0.0) - (free or 0.0)
    errors = _sum(w, "cuda", "cuda.errors")
    _put(out, "cuda_errors_per_s", None if errors is None else errors / span)
    return out


def nccl_features(w: Window) -> dict[str, float]:
    if "nccl" not in w.sources:
        return {}
    out: dict[str, float] = {}
    span = _window_s(w)
    # nccl.dur_ns is host-side enqueue time (a collective returns once its work is queued); the time the
    # host then blocks in its first sync call after a collective (the CUDA tracer's rows, paired in BPF)
    # is the collective's own time, slow peers included. No rows (no CUDA tracer, no such sync yet): masked.
    sync_wait_ns = _sum(w, "cuda", "cuda.nccl_sync_wait_ns")
    _put(out, "nccl_sync_wait_frac", None if sync_wait_ns is None else sync_wait_ns / 1e9 / span)
    calls = _sum(w, "nccl", "nccl.calls", COLLECTIVES)
    if calls is None:
        return out
    op_bytes = _deltas(w, "nccl", "nccl.bytes", COLLECTIVES)
    op_ns = _deltas(w, "nccl", "nccl.dur_ns", COLLECTIVES)
    moved = _total(op_bytes) or 0.0
    busy_ns = _total(op_ns) or 0.0
    out["nccl_calls_per_s"] = calls / span
    out["nccl_bytes_per_s"] = moved / span
    out["nccl_time_frac"] = busy_ns / 1e9 / span
    if busy_ns > 0:
        out["nccl_algbw_gbps"] = moved / busy_ns  # bytes per ns = GB/s
    p50 = _gauges(w, "nccl", "nccl.lat_p50_ns", COLLECTIVES)
    if p50:
        out["nccl_lat_p50_ns"] = sum(a.gauge_sum for a in p50) / sum(a.gauge_n for a in p50)
    p99 = _gauges(w, "nccl", "nccl.lat_p99_ns", COLLECTIVES)
    if p99:
        out["nccl_lat_p99_ns"] = max(a.gauge_last for a in p99)
    # per collective (a device appears once per metric): its p99 and its bytes over its time
    p99_of = {a.device: a for a in p99}
    bytes_of, ns_of = {a.device: a for a in op_bytes}, {a.device: a for a in op_ns}
    for op in COLLECTIVES:
        if op in p99_of:
            out[f"nccl_{op.lower()}_lat_p99_ns"] = p99_of[op].gauge_last
        if op in bytes_of and op in ns_of:
            moved_op, busy_op = _total((bytes_of[op],)), _total((ns_of[op],))
            if busy_op:
                out[f"nccl_{op.lower()}_algbw_gbps"] = moved_op / busy_op
    return out


def python_features(w: Window) -> dict[str, float]:
    if "python" not in w.sources:
        return sampled_python_features(w)
    out: dict[str, float] = {}
    span = _window_s(w)
    gc_ns, gc_n = _sum(w, "python", "python.gc_ns"), _sum(w, "python", "python.gc_count")
    _put(out, "python_gc_frac", None if gc_ns is None else gc_ns / 1e9 / span)
    _put(out, "python_gc_per_s", None if gc_n is None else gc_n / span)
    calls = _deltas(w, "python", "python.calls")
    if calls:
        total = sum(a.delta_sum for a in calls)
        out["python_calls_per_s"] = total / span
        func_ns = [a.delta_sum for a in _deltas(w, "python", "python.func_ns") if a.device != "other"]
        if func_ns:  # inclusive time, so nested calls overlap: the top function's share of the window
            out["python_top_func_share"] = max(func_ns) / 1e9 / span
    return out


def sampled_python_features(w: Window) -> dict[str, float]:
    """Where no USDT probes report (the `python` source is missing), py-spy's samples (source
    `python_sampler`) give python_top_func_share: the largest share of samples with one function as the
    innermost frame (its own time, not inclusive as the USDT figure is), mean over the sampler's
    windows inside this one. No rows, no feature (masked)."""
    if "python_sampler" not in w.sources:
        return {}
    shares = [a.gauge_sum / a.gauge_n for a in _gauges(w, "python_sampler", "python.sample_self_share")]
    return {"python_top_func_share": max(shares)} if shares else {}


@lru_cache(maxsize=4096)
def _torch_class(op: str) -> str:
    name = op.split("::")[-1].lower()
    for cls, fragments in TORCH_CLASSES:
        if any(name.startswith(f) or name.endswith("_" + f)
               for f in fragments):
            return cls
    return "other"


def torch_features(w: Window) -> dict[str, float]:
    if "torch" not in w.sources:
        return {}
    span = _window_s(w)
    out: dict[str, float] = {}
    ops = _deltas(w, "torch", "torch.ops")
    if ops:
        out["torch_ops_per_s"] = sum(a.delta_sum for a in ops) / span
        by_class = {"matmul": 0.0, "elementwise": 0.0, "other": 0.0}
        for agg in ops:
            by_class[_torch_class(agg.device)] += agg.delta_sum
        for cls, n in by_class.items():
            out[f"torch_{cls}_ops_per_s"] = n / span
        op_ns = _sum(w, "torch", "torch.op_ns")
        _put(out, "torch_op_time_frac", None if op_ns is None else op_ns / 1e9 / span)
    # Collectives issued (gloo, the always-on marks of family "collectives"): the job's collective rate
    issued = _sum(w, "torch", "torch.coll_issued")
    _put(out, "torch_collectives_per_s", None if issued is None else issued / span)
    # Collective waits (gloo/c10d, family "waits", duty-cycled and scaled by its sample_frac): threads waiting
    # for peers, on average over the window. The tracer sends a measured 0 while its probes are attached; no
    # rows means no probes (masked).
    comm_ns = _sum(w, "torch", "torch.comm_wait_ns", COMM_WAITS)
    _put(out, "torch_comm_wait_frac", None if comm_ns is None else comm_ns / 1e9 / span)
    comm_n = _sum(w, "torch", "torch.comm_wait_calls", COMM_WAITS)
    _put(out, "torch_comm_waits_per_s", None if comm_n is None else comm_n / span)
    work_ns = _sum(w, "torch", "torch.comm_wait_ns", ("work",))
    _put(out, "torch_work_wait_frac", None if work_ns is None else work_ns / 1e9 / span)
    return out
