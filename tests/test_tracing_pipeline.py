"""From probe to feature: the agent's tracer manager on a real process, into the stream worker.

The CUDA library is the test stand-in (tests/gpu_stub: this machine has no
GPU); the uprobes, the governor's duty cycles, identity from /proc, the wire
codec, windows, features and the chDB store are all real.
"""
from __future__ import annotations

import os
import time

import pytest

from fleetscope.config import Config
from fleetscope.store import open_store
from fleetscope.wire import encode
from fleetscope.producers.agent import identity_rules
from fleetscope.producers.identity import IdentityResolver
from fleetscope.producers.tracers.manager import TracerManager
from fleetscope.streams.processor import MessageRef, StreamProcessor

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loading BPF programs needs root (CI runs as root)")


def test_traced_cuda_calls_become_rank_features_with_sampling_recorded(tmp_path):
    from fleetscope.eval.gpu_stub.build import Workload, build
    bindir = build(tmp_path / "stub")
    env = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "FLEETSCOPE_JOB": "stub-train",
           "FLEETSCOPE_TENANT": "acme"}
    # one rank, two processes: a step loop (copies, syncs, mallocs: always-on families) at 20 steps/s, and a
    # launch-bound thread launching as fast as it can (the expensive family the governor must cycle)
    work = Workload(bindir, "cuda", -1, 20, 0, wait_for_go=False, env=env)
    launcher = Workload(bindir, "launch", -1, 0, 0, wait_for_go=False, env=env)
    cfg = Config(data_dir=tmp_path, trace=("cuda",), trace_pids=(str(work.pid), str(launcher.pid)), trace_auto=False,
                 # a stand-in launch costs nanoseconds, so each 6 µs hit costs ~100x the call: at the default
                 # 1% budget the launch family would get one slice every few seconds; 5% gives several here
                 trace_budget=0.05, trace_duty_period_s=0.5, trace_poll_s=0.2, window_s=1.0, allowed_lateness_s=0.0,
                 warmup_windows=1000, tenant_env_trusted=True)  # the workload names its tenant (acme)
    store = open_store(tmp_path, clickhouse_url=None, prefer_endpoint=False)
    store.migrate()
    manager = None
    try:
        work.loaded()
        launcher.loaded()
        manager = TracerManager(cfg, resolver=IdentityResolver(identity_rules(cfg), host=cfg.host),
                                hit_cost_ns=6000)
        assert set(manager.tracers) == {"cuda"}, manager.unavailable
        manager.start()
        proc = StreamProcessor(cfg, store, producer=None)
        offset = 0
        deadline = time.monotonic() + 6.0
        while time.monotonic() < deadline:
            time.sleep(0.25)
            for batch in manager.sample(time.time_ns()):
                proc.handle(encode(batch), None, MessageRef("fleetscope.raw.cuda", 0, offset))
                offset += 1
        stats = manager.stats()
        proc.flush(force=True)
    finally:
        work.kill()
        launcher.kill()
        if manager is not None:
            manager.close()
    rows = store.query(
        "SELECT feature FROM features WHERE tenant = 'acme' AND job = 'stub-train' AND rank = 2 "
        "ORDER BY window_start").rows
    store_fracs = store.query(
        "SELECT device, min(sample_frac), max(sample_frac) FROM raw_metrics WHERE metric = 'cuda.calls' "
        "GROUP BY device").rows
    launch_rows = store.query(
        "SELECT toUInt64(intDiv(toUnixTimestamp64Nano(ts), 1000000000)) AS w, sum(value / sample_frac), "
        "min(sample_frac) FROM raw_metrics WHERE metric = 'cuda.calls' AND device LIKE '%Launch%' "
        "AND sample_frac > 0 GROUP BY w ORDER BY w").rows  # all of LAUNCH_APIS
    store.close()
    assert stats["trace_targets"] == 2 and stats["trace_errors"] == 0
    assert len(rows) >= 3, rows
    full = [f for (f,) in rows[1:-1]]  # whole windows: the first and last are partly covered
    for f in full:
        # every iteration syncs and copies; the memory and sync families are never duty-cycled
        assert f["cuda_memcpy_bytes_per_s"] > 0 and "cuda_sync_frac" in f and "cuda_mem_live_bytes" in f
    fracs = {dev: (lo, hi) for dev, lo, hi in store_fracs}
    assert fracs["cudaMemcpy"] == (1.0, 1.0)  # always on
    assert 0 < fracs["cudaLaunchKernel"][0] < 0.5  # the governor cycled the launch family; rows say how much
    # each window's launch rate is the sampled counts scaled by 1/sample_frac
    assert launch_rows, "no launch rows"
    by_second = {w: scaled for w, scaled, _ in launch_rows}
    checked = 0
    for (f,) in rows:
        if "cuda_launch_per_s" in f:
            assert f["cuda_launch_per_s"] in [pytest.approx(v, rel=1e-6) for v in by_second.values()]
            checked += 1
    assert checked >= 1, (launch_rows, [sorted(f) for (f,) in rows], stats)
