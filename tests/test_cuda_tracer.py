"""CudaTracer with real eBPF on real processes.

The CUDA libraries are stand-ins (src/fleetscope/eval/gpu_stub: this machine has no GPU):
same exported names and C signatures as libcudart.so.12 and libcuda.so.1,
with durations and return codes set through the environment. Like the real
runtime, the libcudart stand-in enters the driver through libcuda's exported
symbols (GPU_STUB_RUNTIME_ENTERS_DRIVER=0 turns that off). Everything else
is real: uprobes, BPF maps, ring buffer, /proc discovery, ELF symbols.
"""
import os
import time

import pytest
from fleetscope.eval.gpu_stub.batches import index, rows
from support import gpu_fixtures as fixtures

make, stubs = fixtures.make, fixtures.stubs  # pytest fixtures, shared with the other GPU tracer tests

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loading BPF programs needs root (CI runs as root)")

ITERS = 20
VECADD = "vecAdd(float const*, float const*, float*, int)"
RELU = "relu_kernel(float*, int)"


@pytest.fixture
def tracer_cls():
    from fleetscope.producers.tracers.cuda import CudaTracer
    return CudaTracer


def wait_attached(tracer, pid, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not tracer.add_pid(pid):
        assert time.monotonic() < deadline, f"pid {pid} never mapped libcudart"
        time.sleep(0.05)


PROBES = 22  # 14 runtime + 8 driver APIs


@pytest.mark.parametrize("enters_driver", ["1", "0"], ids=["runtime-enters-driver", "runtime-alone"])
def test_every_call_with_arguments_durations_and_return_codes(make, enters_driver):
    """Counted once either way: when the runtime enters the driver, the nested driver calls fire
    their probes (the hits show it) but add no calls, launches or bytes of their own."""
    make_tracer, make_workload = make
    tracer = make_tracer(detail=True)  # the tracer is up before the workload starts
    w = make_workload("cuda", ITERS, 0, late_load=True, env={
        "GPU_STUB_DELAY_US": "cudaStreamSynchronize=2000,cudaDeviceSynchronize=300",
        "GPU_STUB_RC": "cudaMemset=1,cuLaunchKernel=700", "GPU_STUB_RUNTIME_ENTERS_DRIVER": enters_driver})
    assert tracer.add_pid(w.pid) is False  # not yet dlopen()ed: nothing to attach to
    w.load()
    w.loaded()
    assert tracer.add_pid(w.pid) is True
    assert tracer.attached_probes() == PROBES
    started = time.monotonic_ns()
    w.go()
    assert w.finish()[0] == ITERS
    run_ns = time.monotonic_ns() - started
    batch = tracer.sample()
    recs = tracer.records
    by_api = {}
    for r in recs:
        by_api.setdefault(r["api"], []).append(r)
    expect = {"cudaMalloc": 1, "cudaMallocHost": 1, "cudaHostAlloc": 1, "cudaMemcpy": 2, "cudaMemcpyAsync": 1,
              "cudaMemset": 1, "cudaLaunchKernel": 4, "cudaLaunchCooperativeKernel": 1, "cudaGraphLaunch": 1,
              "cudaStreamSynchronize": 1, "cudaDeviceSynchronize": 1, "cudaEventSynchronize": 1,
              "cudaFree": 0.5, "cudaFreeHost": 1.5, "cuMemAlloc_v2": 1, "cuLaunchKernel": 1, "cuLaunchKernelEx": 1,
              "cuStreamSynchronize": 1, "cuMemFree_v2": 1}  # only the driver calls the workload makes itself
    assert {a: len(v) for a, v in by_api.items()} == {a: int(n * ITERS) for a, n in expect.items()}
    assert all(r["pid"] == w.pid for r in recs)

    launches = by_api["cudaLaunchKernel"]
    vec = [r for r in launches if r["kernel"] == VECADD]
    relu = [r for r in launches if r["kernel"] == RELU]
    assert len(vec) == 3 * ITERS and len(relu) == ITERS
    assert {(r["grid"], r["block"], r["shared_mem"], r["stream"]) for r in vec} == {((4, 2, 1), (128, 1, 1), 256, 0x5A5A)}
    assert {(r["grid"], r["block"], r["shared_mem"], r["stream"]) for r in relu} == {((1, 1, 1), (32, 8, 1), 0, 0)}
    coop = by_api["cudaLaunchCooperativeKernel"][0]
    assert (coop["kernel"], coop["grid"], coop["block"], coop["stream"]) == (RELU, (2, 1, 1), (64, 1, 1), 0x5A5A)
    cu = by_api["cuLaunchKernel"][0]
    assert (cu["func"], cu["grid"], cu["block"], cu["shared_mem"], cu["stream"], cu["rc"]) == \
        (0xF00D, (2, 3, 4), (64, 2, 1), 128, 0x5A5A, 700)
    ex = by_api["cuLaunchKernelEx"][0]
    assert (ex["func"], ex["grid"], ex["block"], ex["stream"]) == (0xBEEF, (8, 1, 1), (256, 1, 1), 0x5A5A)
    assert {(r["bytes"], r["kind"]) for r in by_api["cudaMemcpy"]} == {(4096, "HtoD"), (1000, "DtoD")}
    assert {(r["bytes"], r["kind"], r["stream"]) for r in by_api["cudaMemcpyAsync"]} == {(8192, "DtoH", 0x5A5A)}
    assert {(r["bytes"], r["rc"]) for r in by_api["cudaMemset"]} == {(512, 1)}
    assert {r["bytes"] for r in by_api["cudaMalloc"]} == {1 << 20}
    assert {r["bytes"] for r in by_api["cudaHostAlloc"]} == {32768}
    assert all(r["ptr"] >= 0x7F0000000000 for r in by_api["cudaMallocHost"] + by_api["cudaHostAlloc"])  # host range
    allocated = {r["ptr"] for r in by_api["cudaMalloc"]}
    assert len(allocated) == ITERS and 0 not in allocated
    assert {r["ptr"] for r in by_api["cudaFree"]} < allocated
    assert {r["bytes"] for r in by_api["cudaFree"]} == {1 << 20}
    assert {r["handle"] for r in by_api["cudaEventSynchronize"]} == {0x7000}
    assert {(r["graph"], r["stream"]) for r in by_api["cudaGraphLaunch"]} == {(0x6000, 0x5A5A)}
    for api, delay in (("cudaStreamSynchronize", 2_000_000), ("cudaDeviceSynchronize", 300_000)):
        durs = sorted(r["dur_ns"] for r in by_api[api])
        assert durs[0] >= delay, (api, durs[:3])  # the stand-in's sleep is inside every measured call
        # each call paired with its own return, not a later one: no duration spans more than the whole run
        # (a bound on pairing, not on speed: a loaded machine stretches calls, never past the run)
        assert durs[-1] < run_ns, (api, durs[-3:], run_ns)
    for r in recs:
        assert abs(r["ts_ns"] - time.time_ns()) < 60e9  # epoch ns, not monotonic

    got = index([batch], w.pid)
    for api, n in expect.items():
        label = {"cuMemAlloc_v2": "cuMemAlloc", "cuMemFree_v2": "cuMemFree"}.get(api, api)
        assert got[("cuda.calls", label)] == n * ITERS, api
    assert not {k for k in got if k[0] == "cuda.calls" and k[1] in ("cuMemHostAlloc", "cuMemAllocHost", "cuMemFreeHost")}
    assert got[("cuda.errors", "cudaMemset")] == ITERS and got[("cuda.errors", "cuLaunchKernel")] == ITERS
    # the driver's failure is the runtime call's failure when the runtime enters the driver
    assert got[("cuda.errors", "cudaLaunchKernel")] == (4 * ITERS if enters_driver == "1" else 0)
    assert got[("cuda.errors", "cudaMemcpy")] == 0
    assert got[("cuda.launches", VECADD)] == 3 * ITERS
    assert got[("cuda.launches", RELU)] == 2 * ITERS  # cudaLaunchKernel + cudaLaunchCooperativeKernel
    assert got[("cuda.launches", "CUfunction@0xf00d")] == ITERS
    assert {k for k in got if k[0] == "cuda.launches"} == {("cuda.launches", n) for n in (VECADD, RELU, "CUfunction@0xf00d",
                                                                                           "CUfunction@0xbeef")}
    assert got[("cuda.memcpy_bytes", "HtoD")] == 4096 * ITERS
    assert got[("cuda.memcpy_bytes", "DtoH")] == 8192 * ITERS
    assert got[("cuda.memcpy_bytes", "DtoD")] == 1000 * ITERS
    assert got[("cuda.bytes", "cudaMemcpy")] == 5096 * ITERS
    assert got[("cuda.bytes", "cudaMemset")] == 512 * ITERS
    mib, drv, host, mapped = 1 << 20, 2048, 65536, 32768
    assert got[("cuda.malloc_bytes", "all")] == (mib + drv) * ITERS  # device memory only: pinned host apart
    assert got[("cuda.free_bytes", "all")] == (mib // 2 + drv) * ITERS
    assert got[("cuda.mem_live_bytes", "all")] == mib * ITERS // 2  # odd iterations leak their 1 MiB
    assert got[("cuda.mem_live_allocs", "all")] == ITERS // 2
    assert got[("cuda.pinned_alloc_bytes", "all")] == (host + mapped) * ITERS
    assert got[("cuda.pinned_free_bytes", "all")] == (host + mapped // 2) * ITERS
    assert got[("cuda.pinned_live_bytes", "all")] == mapped * ITERS // 2  # and 32 KiB of pinned memory
    assert got[("cuda.pinned_live_allocs", "all")] == ITERS // 2
    p50 = got[("cuda.lat_p50_ns", "cudaStreamSynchronize")]
    assert 2_000_000 <= p50 * 1.125 and p50 < 3_500_000, p50  # bucket midpoint: within 12.5%
    assert got[("cuda.lost_events", "all")] == 0
    for r in rows(batch):
        assert r["sample_frac"] == pytest.approx(1.0, abs=0.01)
        assert (r["interval_ns"] == 0) == str(r["metric"]).startswith(("cuda.lat_", "cuda.mem_live", "cuda.pinned_live"))
    # Probe hits, nested driver calls included: 5 launches, 5 allocations/frees, 1 stream sync enter the driver.
    nested = {"launch": 5, "memory": 5, "sync": 1} if enters_driver == "1" else {"launch": 0, "memory": 0, "sync": 0}
    assert tracer.hits() == {f: (n + nested[f]) * ITERS for f, n in {"launch": 8, "memory": 11, "sync": 4}.items()}


def test_a_runtime_that_loads_the_driver_later_still_counts_each_launch_once(make):
    """The real order: libcudart is mapped first and loads libcuda on its first call; the
    tracer picks libcuda up at a later sample. Before and after, one launch is one count."""
    make_tracer, make_workload = make
    tracer = make_tracer()
    w = make_workload("launch", -1, 200)
    w.loaded()
    assert tracer.add_pid(w.pid) and set(tracer.libs[w.pid]) == {"cudart"}  # no driver yet
    w.go()
    deadline = time.monotonic() + 20
    while "cuda" not in tracer.libs[w.pid]:  # the runtime's first call dlopens the driver
        assert time.monotonic() < deadline, "the driver was never picked up"
        tracer.sample()
        time.sleep(0.05)
    hits0 = tracer.hits()["launch"]
    tracer.sample()
    while tracer.hits()["launch"] - hits0 < 200:  # ~100 launches, each firing the runtime and the driver probe
        time.sleep(0.05)
    hits1 = tracer.hits()["launch"]
    got = index([tracer.sample()], w.pid)
    calls = got[("cuda.calls", "cudaLaunchKernel")]
    # The workload keeps launching while the sample reads the calls map and then the launches map, so the two can
    # differ by the launch or two that fell between the reads (seen: 101 against 100 in a loaded CI run); a launch
    # counted twice, once by the runtime probe and once by the driver's, would double the count instead.
    assert calls >= 50 and abs(got[("cuda.launches", VECADD)] - calls) <= 2, (got[("cuda.launches", VECADD)], calls)
    assert not [k for k in got if k[1].startswith(("cuLaunchKernel", "CUfunction"))], got
    # every counted launch also hit the driver's probe, which skipped it (the reads straddle a few calls)
    assert abs((hits1 - hits0) - 2 * calls) <= 6, (hits1 - hits0, calls)


def test_attach_after_start_untraced_process_and_exit_mid_trace(make):
    make_tracer, make_workload = make
    traced = make_workload("cuda", -1, 100, wait_for_go=False)
    untraced = make_workload("cuda", -1, 100, wait_for_go=False)
    traced.loaded()
    untraced.loaded()
    time.sleep(0.3)  # it has been calling, with nothing attached
    tracer = make_tracer()  # default mode: maps only, no per-call records
    assert b"calls" not in tracer.bpf.tables and tracer.records == []
    assert tracer.add_pid(traced.pid)
    tracer.sample()
    t0 = time.monotonic()
    time.sleep(1.0)
    batch = tracer.sample()
    elapsed = time.monotonic() - t0
    got = rows(batch)
    assert {r["pid"] for r in got} <= {traced.pid, 0}, "the untraced process must not be seen"
    idx = index([batch], traced.pid)
    launches = idx[("cuda.calls", "cudaLaunchKernel")]
    assert 0.7 * 400 * elapsed <= launches <= 1.15 * 400 * elapsed, (launches, elapsed)  # 4 per iteration, 100 Hz
    # The stats and launches maps are read one after the other, so an iteration may straddle the reads.
    assert abs(idx[("cuda.launches", VECADD)] - 0.75 * launches) <= 4
    # Frees of pointers allocated before attach are not counted; live memory is what was allocated since.
    assert idx[("cuda.mem_live_bytes", "all")] >= 0
    assert idx[("cuda.lost_events", "all")] == 0

    traced.kill()  # exits mid-trace
    batch = tracer.sample()  # its last deltas, then it is dropped
    assert traced.pid not in tracer.pids and tracer.attached_probes() == 0
    assert ("cuda.lost_events", "all") in index([batch])
    time.sleep(0.2)
    after = rows(tracer.sample())
    assert [r["metric"] for r in after] == ["cuda.lost_events"]


def test_launch_family_detaches_for_real_and_reports_its_fraction(make):
    make_tracer, make_workload = make
    w = make_workload("cuda", -1, 200, wait_for_go=False)
    w.loaded()
    tracer = make_tracer()
    assert tracer.add_pid(w.pid)
    assert tracer.families() == {"launch": "expensive", "memory": "always", "sync": "always"}
    tracer.sample()
    t0 = time.monotonic()
    time.sleep(0.5)
    t_off = time.monotonic()
    tracer.set_family_enabled("launch", False)
    assert tracer.attached_probes() == PROBES - 5  # 3 runtime + 2 driver launch probes really detached
    hits_off = tracer.hits()["launch"]
    time.sleep(0.5)
    assert tracer.hits()["launch"] == hits_off  # a detached probe costs and counts nothing
    t1 = time.monotonic()
    batch = tracer.sample()
    fr = {(str(r["metric"]), str(r["device"])): r["sample_frac"] for r in rows(batch)}
    # Attached from the first sample until the detach began (detaching itself takes a while).
    assert fr[("cuda.calls", "cudaLaunchKernel")] == pytest.approx((t_off - t0) / (t1 - t0), abs=0.05)
    assert fr[("cuda.calls", "cudaMemcpy")] == pytest.approx(1.0, abs=0.01)
    time.sleep(0.3)
    later = index([tracer.sample()], w.pid)
    assert ("cuda.calls", "cudaLaunchKernel") not in later and later[("cuda.calls", "cudaMemcpy")] > 0
    tracer.set_family_enabled("launch", True)
    assert tracer.attached_probes() == PROBES
    with pytest.raises(KeyError, match="no probe family"):
        tracer.set_family_enabled("python", True)


def test_kernel_names_are_capped_per_pid(make):
    from fleetscope.producers.tracers.symbols import OTHER, Symbolizer

    _, make_workload = make
    w = make_workload("cuda", 1, 0)
    w.loaded()
    exe = next(line for line in open(f"/proc/{w.pid}/maps") if line.rstrip().endswith("/workload") and " r-xp " in line)
    lo, off = int(exe.split("-")[0], 16), int(exe.split()[2], 16)
    import subprocess
    syms = dict(reversed(line.split(" T ")) for line in subprocess.run(
        ["nm", str(w.proc.args[0])], capture_output=True, text=True).stdout.splitlines() if " T _Z" in line)
    vec, relu = (lo - off + int(syms[s].strip(), 16) for s in ("_Z6vecAddPKfS0_Pfi", "_Z11relu_kernelPfi"))
    s = Symbolizer(cap=1)
    assert s.name(w.pid, vec) == VECADD
    assert s.name(w.pid, vec) == VECADD
    assert s.name(w.pid, relu) == OTHER
    assert Symbolizer(cap=5).name(w.pid, relu) == RELU


def test_not_root_is_a_clear_error(monkeypatch):
    from fleetscope.producers.tracers import gpu_calls
    from fleetscope.producers.tracers.cuda import CudaTracer
    from fleetscope.producers.tracers.kernel import TracerUnavailable

    monkeypatch.setattr(gpu_calls.os, "geteuid", lambda: 1000)
    with pytest.raises(TracerUnavailable, match="root"):
        CudaTracer("node-a")
