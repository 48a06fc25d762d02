"""The host's wait for its collectives: the first sync call after an NCCL call, with real eBPF on real processes.

An NCCL call returns once its work is queued, so nccl.dur_ns is enqueue time. The CUDA program counts
the time the thread then blocks in its first sync call (cuda.nccl_sync_wait_ns), paired in BPF through
the map the NCCL program marks, and the stream worker makes it nccl_sync_wait_frac. libcudart and
libnccl are the test stand-ins (src/fleetscope/eval/gpu_stub: no GPU here), whose sync calls sleep a
set time; the uprobes, maps, both tracers, windows and features are real.
"""
import os
import time

import pytest
from fleetscope.eval.gpu_stub.batches import index
from fleetscope.streams.features import window_features
from fleetscope.streams.windows import WindowAssembler
from support import gpu_fixtures as fixtures

stubs = fixtures.stubs  # the stand-ins, built once for the module

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loading BPF programs needs root (CI runs as root)")

ITERS = 15
STREAM_SYNC_MS, EVENT_SYNC_MS, DEVICE_SYNC_MS = 20, 45, 25
# per iteration (workload.c, mode nccl_sync): cudaEventSynchronize with no collective before it, ncclAllReduce,
# cudaStreamSynchronize (the collective's), cudaDeviceSynchronize (a second sync): only the stream sync counts
DELAYS = (f"cudaStreamSynchronize={STREAM_SYNC_MS * 1000},cudaEventSynchronize={EVENT_SYNC_MS * 1000},"
          f"cudaDeviceSynchronize={DEVICE_SYNC_MS * 1000},ncclAllReduce=300")


@pytest.fixture
def tracers():
    from fleetscope.producers.tracers.cuda import CudaTracer
    from fleetscope.producers.tracers.nccl import NcclTracer
    made = []

    def make(cls):
        made.append(cls("node-a"))
        return made[-1]

    try:
        yield make, CudaTracer, NcclTracer
    finally:
        for t in made:
            t.close()


def run_traced(stubs, mode, tracers, env):
    """Run the workload to its end under the given tracers, sampling them as the agent does; their batches."""
    from fleetscope.eval.gpu_stub.build import Workload
    w = Workload(stubs, mode, ITERS, 0, env=env)
    batches = []
    try:
        w.loaded()
        for t in tracers:
            assert t.add_pid(w.pid), type(t).__name__
        w.go()
        while w.proc.poll() is None:  # the agent's ticks while the job runs
            time.sleep(0.25)
            batches += [t.sample() for t in tracers]
        batches += [t.sample() for t in tracers]  # its last calls
    finally:
        w.kill()
    return w.pid, [b for b in batches if b is not None]


def features_per_window(batches):
    assembler = WindowAssembler(window_s=1.0, allowed_lateness_s=0, idle_close_s=60)
    for b in batches:
        assembler.add(b, None)
    return [(w, window_features(w)) for w in assembler.pop_closed(force=True)]


def test_the_wait_in_the_first_sync_after_a_collective_is_counted_and_no_other_sync(stubs, tracers):
    make, CudaTracer, NcclTracer = tracers
    nccl = make(NcclTracer)  # loaded before the CUDA program: the shared map does not care which comes first
    cuda = make(CudaTracer)
    pid, batches = run_traced(stubs, "nccl_sync", (cuda, nccl), {"GPU_STUB_DELAY_US": DELAYS})

    got = index(batches, pid)
    # every sync was traced, and only the one after each all-reduce was paired with it
    for api in ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize"):
        assert got[("cuda.calls", api)] == ITERS, api
    assert got[("nccl.calls", "AllReduce")] == ITERS
    assert got[("cuda.nccl_syncs", "all")] == ITERS
    wait_ns = got[("cuda.nccl_sync_wait_ns", "all")]
    # at least the stand-in's sleep; well under it plus either other sync's (counting one would add >= 25 ms each)
    assert ITERS * STREAM_SYNC_MS * 1e6 <= wait_ns < ITERS * (STREAM_SYNC_MS + 10) * 1e6, wait_ns
    assert got[("cuda.lost_events", "all")] == 0 and got[("nccl.lost_events", "all")] == 0

    windows = features_per_window(batches)
    with_wait = [(w, f) for w, f in windows if "nccl_sync_wait_frac" in f]
    assert with_wait, [sorted(f) for _, f in windows]
    # the feature is the share of each window spent so; over the windows it adds up to the known wait
    total_s = sum(f["nccl_sync_wait_frac"] * (w.end_ns - w.start_ns) / 1e9 for w, f in with_wait)
    assert total_s == pytest.approx(wait_ns / 1e9, rel=1e-6)
    # the enqueue times the nccl features see are a small part of it: the collective's real time was hidden there
    enqueue_s = sum(f.get("nccl_time_frac", 0.0) * (w.end_ns - w.start_ns) / 1e9 for w, f in windows)
    assert enqueue_s < total_s / 10, (enqueue_s, total_s)


def test_syncs_with_no_collective_before_them_give_no_wait_rows_and_the_feature_is_masked(stubs, tracers):
    make, CudaTracer, NcclTracer = tracers
    cuda = make(CudaTracer)
    make(NcclTracer)  # loaded, but this process maps no libnccl: nothing marks its threads
    pid, batches = run_traced(stubs, "cuda", (cuda,), {"GPU_STUB_DELAY_US": DELAYS})
    got = index(batches, pid)
    assert got[("cuda.calls", "cudaStreamSynchronize")] == ITERS  # the syncs were traced
    assert not [k for k in got if k[0].startswith("cuda.nccl_sync")], sorted(got)
    assert all("nccl_sync_wait_frac" not in f for _, f in features_per_window(batches))
