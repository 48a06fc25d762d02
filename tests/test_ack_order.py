"""Acknowledgements reach Faust in offset order per partition (streams/ack_order.py).

Faust commits the first run of consecutive acknowledged offsets without always checking that the run starts at
the committed offset (the last test shows it on Faust's own arithmetic), so an acknowledgement handed over ahead
of an earlier message could let a commit pass that message. Here the ordering itself, with plain callables for
Faust's acks, and the gauge of held releases in the worker's stats; the chaos suite and the scale-out tests run
it with real Faust workers and a real broker.
"""
from fleetscope.streams.ack_order import PartitionAckOrder
from fleetscope.streams.worker_metrics import WorkerCollector
from support.host_processor import FakeClock, make_processor


def tracked(order, topic, partition, offsets, acked):
    return {o: order.track(topic, partition, o, lambda o=o: acked.append((topic, partition, o))) for o in offsets}


def test_a_release_waits_for_every_earlier_message_of_its_partition():
    order, acked = PartitionAckOrder(), []
    release = tracked(order, "raw", 0, [10, 11, 12, 13], acked)
    release[12]()
    release[11]()
    assert acked == [] and order.held == 2  # 10 is still held in an open window
    release[10]()
    assert acked == [("raw", 0, 10), ("raw", 0, 11), ("raw", 0, 12)] and order.held == 0
    release[13]()
    release[13]()  # twice: once to Faust
    assert acked[-1] == ("raw", 0, 13) and len(acked) == 4


def test_partitions_and_topics_do_not_wait_for_each_other():
    order, acked = PartitionAckOrder(), []
    p0 = tracked(order, "raw", 0, [5, 6], acked)
    p1 = tracked(order, "raw", 1, [5], acked)
    other = tracked(order, "gpu", 0, [1], acked)
    p0[6]()
    p1[5]()
    other[1]()
    assert acked == [("raw", 1, 5), ("gpu", 0, 1)]


def test_a_revoked_partition_drops_its_held_releases_and_starts_anew_when_it_comes_back():
    order, acked = PartitionAckOrder(), []
    before = tracked(order, "raw", 0, [20, 21, 22], acked)
    before[21]()
    order.forget({("raw", 0)})
    assert order.held == 0
    before[20]()  # a flush that finishes after the revoke: its new owner reads it again, it is not acknowledged
    assert acked == []
    after = tracked(order, "raw", 0, [20, 21], acked)  # assigned back: read again from the committed offset
    after[20]()
    assert acked == [("raw", 0, 20)]


def test_a_partition_read_again_from_an_earlier_offset_starts_a_new_run():
    order, acked = PartitionAckOrder(), []
    first = tracked(order, "raw", 0, [30, 31], acked)
    first[31]()
    again = tracked(order, "raw", 0, [30, 31], acked)  # a seek back to the committed offset
    first[30]()  # the old run's release changes nothing
    assert acked == [] and order.held == 0
    again[30]()
    again[31]()
    assert acked == [("raw", 0, 30), ("raw", 0, 31)]


def test_the_premise_faust_commits_past_an_unacknowledged_message_at_the_head():
    """Why the order matters, on Faust's own commit arithmetic (Consumer._new_offset, called on a plain object
    holding the state it reads): with offset 101 next to commit and only 102 acknowledged, Faust commits 103,
    past 101. If this ever fails, Faust checks the head itself and PartitionAckOrder could go."""
    from collections import defaultdict
    from types import SimpleNamespace

    from faust.transport.consumer import Consumer
    from faust.types import TP

    tp = TP("raw", 0)
    state = SimpleNamespace(_acked=defaultdict(list, {tp: [102]}), _acked_index=defaultdict(set, {tp: {102}}),
                            _gap=defaultdict(lambda: None), _committed_offset=defaultdict(lambda: None, {tp: 101}))
    assert Consumer._new_offset(state, tp) == 103  # 101, still in an open window, would be skipped
    order, acked = PartitionAckOrder(), []
    release = tracked(order, "raw", 0, [101, 102], acked)
    release[102]()
    assert acked == []  # held until 101 is released: Faust never sees 102 alone


def test_the_worker_reports_the_held_releases_in_its_stats(store, tmp_path):
    proc = make_processor(store, FakeClock(), tmp_path)
    assert proc.snapshot()["held_acks"] == 0  # no ordering (in-process): nothing held
    proc.ack_order = order = PartitionAckOrder()  # as the Faust worker wires it (streams/app.py)
    release = tracked(order, "raw", 0, [1, 2], [])
    release[2]()
    assert proc.snapshot()["held_acks"] == 1
    held = [f for f in WorkerCollector(proc).collect() if f.name == "fleetscope_worker_held_acks"]
    assert [s.value for f in held for s in f.samples] == [1.0]  # and on the worker's /metrics
