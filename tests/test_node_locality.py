"""Naming the ranks a change lands on, from their own CPUs' interrupt work (streams/model/locality.py); the scorer
end to end with it is in tests/test_scoring_stream.py."""
from __future__ import annotations

from fleetscope.streams.model.locality import LOCAL_FEATURE, local_rows


def step(shares):
    evidence = [{LOCAL_FEATURE: x} if x is not None else {} for x in shares]
    return list(range(len(shares))), evidence


def test_the_rank_whose_cpu_takes_the_softirq_flood_is_local():
    """As in the dev scenario irq_storm: rank 1 pinned on the flooded CPU, its peers on the other one."""
    rows, evidence = step([0.004, 0.31, 0.006])
    assert local_rows(rows, evidence) == [1]


def test_a_peer_seen_on_both_cpus_sits_halfway_and_the_flooded_rank_is_still_local():
    """irq_storm, 3 of its node windows: a peer ran on the flooded CPU part of the window. A peer z said 0.7."""
    rows, evidence = step([0.0, 0.15, 0.075])
    assert local_rows(rows, evidence) == [1]


def test_a_few_thousandths_of_interrupt_time_name_no_rank_however_odd_one_looks():
    rows, evidence = step([0.001, 0.012, 0.0011])
    assert local_rows(rows, evidence) == []


def test_shares_that_differ_by_less_than_a_third_of_the_higher_are_one_load():
    rows, evidence = step([0.10, 0.14, 0.10])
    assert local_rows(rows, evidence) == []


def test_interrupt_work_on_most_ranks_cpus_is_the_nodes_not_a_ranks():
    rows, evidence = step([0.30, 0.29, 0.31, 0.002])
    assert local_rows(rows, evidence) == []


def test_two_ranks_cannot_say_which_one_is_odd():
    rows, evidence = step([0.002, 0.30])
    assert local_rows(rows, evidence) == []


def test_ranks_without_the_share_are_left_out_not_counted_as_quiet():
    rows, evidence = step([0.004, 0.31, None, 0.005])
    assert local_rows(rows, evidence) == [1]
    rows, evidence = step([None, 0.31, None, 0.005])
    assert local_rows(rows, evidence) == []
