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
    # and its collectives are not numbered: this rank's count would not start where its peers' did
    assert not any(k[0] in ("nccl.comm_seq", "nccl.coll_entry_ns") for k in got)
    for r in rows(batch):
        assert r["sample_frac"] == pytest.approx(1.0, abs=0.01)
    w.kill()
    tracer.sample()
    assert w.pid not in tracer.pids and tracer.attached_probes() == 0
    assert [r["metric"] for r in rows(tracer.sample())] == ["nccl.lost_events"]


def test_each_communicator_numbers_its_collectives_from_its_init_and_marks_their_entry_times(make):
    """The n-th collective of a communicator is the same call on every rank: counted from the traced init, under
    the uid every rank was given (the ncclUniqueId's first 8 bytes; workload.c fills it with 0x11), with the
    entry times of the latest SEQ_MARKS sent once each."""
    from fleetscope.producers.tracers.nccl import SEQ_MARKS
    make_tracer, make_workload = make
    tracer = make_tracer(detail=True)
    w = make_workload("nccl", ITERS, 0)
    w.loaded()
    assert tracer.add_pid(w.pid)
    t0 = time.time_ns()
    w.go()
    assert w.finish()[0] == ITERS
    batch = tracer.sample()
    init = next(r for r in tracer.records if r["api"] == "ncclCommInitRank")
    uid = "11" * 8
    assert init["uid"] == uid
    got = index([batch], w.pid)
    sequenced = 5 * ITERS  # AllReduce, AllGather, ReduceScatter, Broadcast, Reduce; not Send/Recv or groups
    assert got[("nccl.comm_seq", uid)] == sequenced
    marks = {int(k[1].split("#")[1]): v for k, v in got.items() if k[0] == "nccl.coll_entry_ns"}
    assert sorted(marks) == list(range(sequenced - SEQ_MARKS + 1, sequenced + 1))
    times = [marks[n] for n in sorted(marks)]
    assert times == sorted(times) and t0 <= times[0] and times[-1] <= time.time_ns()
    again = index([tracer.sample()], w.pid)  # the process is gone now, its rows with it; nothing is sent twice
    assert not any(k[0] == "nccl.coll_entry_ns" for k in again)


def test_a_fast_communicator_is_marked_sparsely_so_every_rank_keeps_the_same_numbers():
    from fleetscope.producers.tracers.nccl import MARKS_PER_TICK, mark_shift
    assert [mark_shift(n) for n in (0, 1, MARKS_PER_TICK)] == [0, 0, 0]
    assert [mark_shift(n) for n in (MARKS_PER_TICK + 1, 2 * MARKS_PER_TICK, 2 * MARKS_PER_TICK + 1)] == [1, 1, 2]
    assert mark_shift(10**12) == 15  # the BPF side reads 4 bits


def test_marks_thin_out_on_a_communicator_too_fast_for_the_ring(make):
    from fleetscope.producers.tracers.nccl import mark_shift
    make_tracer, make_workload = make
    tracer = make_tracer()
    w = make_workload("nccl", -1, 200)  # 200 iterations/s of 5 sequenced collectives
    w.loaded()
    assert tracer.add_pid(w.pid)
    w.go()
    time.sleep(0.5)
    first = index([tracer.sample()], w.pid)
    time.sleep(0.5)
    second = index([tracer.sample()], w.pid)
    w.kill()
    uid = "11" * 8
    per_tick = second[("nccl.comm_seq", uid)] - first[("nccl.comm_seq", uid)]
    shift = mark_shift(per_tick)  # what the first sample's count set, and the second's agrees
    assert shift >= 2, per_tick
    marked = [int(k[1].split("#")[1]) for k in second if k[0] == "nccl.coll_entry_ns"]
    # after the first sample set the shift, only every 2^shift-th is marked (a nested coarser one as well)
    late = [n for n in marked if n > first[("nccl.comm_seq", uid)] + per_tick // 4]
    assert late and all(n % (1 << (shift - 1)) == 0 for n in late), (shift, sorted(late)[:10])
