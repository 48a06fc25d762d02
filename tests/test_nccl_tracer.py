"""NcclTracer with real eBPF on real processes.

libnccl.so.2 is a stand-in (tests/gpu_stub: no GPU or NCCL here) with NCCL's
exported names and C signatures; durations and return codes come from the
environment. Uprobes, maps, ring buffer and /proc discovery are real.
"""
import os
import time

import pytest
from fleetscope.eval.gpu_stub.batches import index, rows
from support import gpu_fixtures as fixtures

make, stubs = fixtures.make, fixtures.stubs  # pytest fixtures, shared with the other GPU tracer tests

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loading BPF programs needs root (CI runs as root)")

ITERS = 25
# call -> (count, datatype name, bytes per call), as tests/gpu_stub/workload.c issues them
CALLS = {"AllReduce": (1000, "float32", 4000), "AllGather": (256, "float16", 512),
         "ReduceScatter": (100, "float64", 800), "Broadcast": (10, "int8", 10), "Reduce": (50, "int64", 400),
         "Send": (64, "int32", 256), "Recv": (32, "bfloat16", 64)}


@pytest.fixture
def tracer_cls():
    from fleetscope.producers.tracers.nccl import NcclTracer
    return NcclTracer


def test_every_call_bytes_per_datatype_peers_comm_and_return_codes(make):
    make_tracer, make_workload = make
    tracer = make_tracer(detail=True)
    w = make_workload("nccl", ITERS, 0, late_load=True,
                      env={"GPU_STUB_DELAY_US": "ncclAllReduce=500", "GPU_STUB_RC": "ncclSend=5"})
    assert tracer.add_pid(w.pid) is False  # libnccl not mapped yet
    w.load()
    w.loaded()
    assert tracer.add_pid(w.pid) is True
    assert tracer.families() == {"collectives": "always"}
    w.go()
    assert w.finish()[0] == ITERS
    batch = tracer.sample()
    by_api = {}
    for r in tracer.records:
        by_api.setdefault(r["api"][4:], []).append(r)
    assert {k: len(v) for k, v in by_api.items()} == {**dict.fromkeys(CALLS, ITERS), "GroupStart": ITERS,
                                                      "GroupEnd": ITERS, "CommInitRank": 1}
    init = by_api["CommInitRank"][0]
    assert (init["rank"], init["nranks"], init["rc"]) == (2, 4, 0) and init["comm"] != 0
    for call, (count, dtype, nbytes) in CALLS.items():
        seen = {(r["count"], r["datatype"], r["bytes"], r["comm"], r["stream"]) for r in by_api[call]}
        assert seen == {(count, dtype, nbytes, init["comm"], 0x5A5A)}, call
    assert {r["op"] for r in by_api["AllReduce"]} == {"sum"}
    assert {(r["op"], r["root"]) for r in by_api["Reduce"]} == {("max", 0)}
    assert {r["root"] for r in by_api["Broadcast"]} == {1}
    assert {(r["peer"], r["rc"]) for r in by_api["Send"]} == {(3, 5)}
    assert {(r["peer"], r["rc"]) for r in by_api["Recv"]} == {(1, 0)}
    durs = sorted(r["dur_ns"] for r in by_api["AllReduce"])
    assert durs[0] >= 500_000 and durs[len(durs) // 2] < 1_500_000, durs

    got = index([batch], w.pid)
    for call, (_, _, nbytes) in CALLS.items():
        assert got[("nccl.calls", call)] == ITERS
        assert got[("nccl.bytes", call)] == nbytes * ITERS
    assert got[("nccl.errors", "Send")] == ITERS and got[("nccl.errors", "AllReduce")] == 0
    assert got[("nccl.peer_bytes", "Send:peer3")] == 256 * ITERS
    assert got[("nccl.peer_bytes", "Recv:peer1")] == 64 * ITERS
    comm = f"0x{init['comm']:x}"
    assert (got[("nccl.comm_rank", comm)], got[("nccl.comm_nranks", comm)]) == (2, 4)
    p50 = got[("nccl.lat_p50_ns", "AllReduce")]
    assert 500_000 <= p50 * 1.125 and p50 < 1_500_000, p50
    assert got[("nccl.lost_events", "all")] == 0
    assert tracer.hits() == {"collectives": 9 * ITERS + 1}  # 7 calls + GroupStart/End per iteration


def test_communicators_made_as_pytorch_makes_them_are_mapped_and_peer_bytes_flow(make):
    """ncclCommInitRankConfig (ProcessGroupNCCL's init), ncclCommSplit (new_group with a split
    parent; PyTorch passes the new group rank as the key) and ncclCommInitAll (one process,
    many GPUs): each communicator's rank is known, and its size where the call carries it."""
    make_tracer, make_workload = make
    tracer = make_tracer(detail=True)
    w = make_workload("nccl_torch", ITERS, 0, env={"GPU_STUB_RC": "ncclSend=0"})
    w.loaded()
    assert tracer.add_pid(w.pid)
    w.go()
    assert w.finish()[0] == ITERS
    batch = tracer.sample()
    by_api = {}
    for r in tracer.records:
        by_api.setdefault(r["api"][4:], []).append(r)
    assert {k: len(v) for k, v in by_api.items() if k.startswith("Comm")} == \
        {"CommInitRankConfig": 1, "CommSplit": 2, "CommInitAll": 1}
    init = by_api["CommInitRankConfig"][0]
    assert (init["rank"], init["nranks"], init["rc"]) == (2, 4, 0) and init["comm"]
    member, left_out = sorted(by_api["CommSplit"], key=lambda r: r["color"], reverse=True)
    assert (member["parent"], member["color"], member["rank"]) == (init["comm"], 7, 1) and member["comm"]
    assert (left_out["color"], left_out["comm"]) == (-1, 0)  # NCCL_SPLIT_NOCOLOR: no communicator
    got = index([batch], w.pid)
    ranks = {k[1]: v for k, v in got.items() if k[0] == "nccl.comm_rank"}
    sizes = {k[1]: v for k, v in got.items() if k[0] == "nccl.comm_nranks"}
    world, sub = f"0x{init['comm']:x}", f"0x{member['comm']:x}"
    assert ranks[world] == 2 and sizes[world] == 4
    assert ranks[sub] == 1 and sub not in sizes  # a split's size is not an argument
    pair = {c: r for c, r in ranks.items() if c not in (world, sub)}
    assert sorted(pair.values()) == [0, 1] and all(sizes[c] == 2 for c in pair)  # ncclCommInitAll's two
    assert len(ranks) == 4
    # point-to-point on the split communicator still counts per peer
    assert {(r["comm"], r["peer"]) for r in by_api["Send"]} == {(member["comm"], 3)}
    assert got[("nccl.peer_bytes", "Send:peer3")] == 256 * ITERS
    assert got[("nccl.peer_bytes", "Recv:peer1")] == 64 * ITERS
    assert got[("nccl.calls", "AllReduce")] == ITERS and got[("nccl.lost_events", "all")] == 0


def test_attach_after_start_and_exit_mid_trace(make):
    make_tracer, make_workload = make
    w = make_workload("nccl", -1, 200, wait_for_go=False)
    w.loaded()
    time.sleep(0.3)  # ncclCommInitRank already happened, before the tracer existed
    tracer = make_tracer()
    assert tracer.add_pid(w.pid)
    tracer.sample()
    t0 = time.monotonic()
    time.sleep(1.0)
    batch = tracer.sample()
    elapsed = time.monotonic() - t0
    got = index([batch], w.pid)
    n = got[("nccl.calls", "AllReduce")]
    assert 0.7 * 200 * elapsed <= n <= 1.15 * 200 * elapsed, (n, elapsed)
    assert abs(got[("nccl.bytes", "AllReduce")] - 4000 * n) <= 4000 * 2
    assert not any(k[0] == "nccl.comm_rank" for k in got)  # the comm was formed before attach: unknown
    for r in rows(batch):
        assert r["sample_frac"] == pytest.approx(1.0, abs=0.01)
    w.kill()
    tracer.sample()
    assert w.pid not in tracer.pids and tracer.attached_probes() == 0
    assert [r["metric"] for r in rows(tracer.sample())] == ["nccl.lost_events"]
