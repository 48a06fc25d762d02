"""Is a job step's slowdown one rank's doing, or the whole job's? roles.differs_from_peers (a culprit the
peer comparison flagged) and roles.explains_slowdown (last arrivers their peers wait for long enough).
Wait shares are of a window; the numbers are the dev scenarios' runs (job_wide_slowdown, straggler_cpu_quota)
as their stores hold them."""
from __future__ import annotations

import math

from fleetscope.streams.model.roles import ARRIVAL_WAIT, differs_from_peers, explains_slowdown


def step(*waits):
    return [{ARRIVAL_WAIT: w} for w in waits]


def test_a_culprit_the_peer_comparison_flagged_differs_from_its_peers():
    assert differs_from_peers(["gmm", "peer"])           # the dev straggler's culprit, every window
    assert differs_from_peers(["wait"])                  # promoted: every flagged peer waited for it
    assert not differs_from_peers(["gmm"])               # job_wide_slowdown: its own history only, like its peers
    assert not differs_from_peers(["gmm", "job_rate"])
    assert not differs_from_peers([])


def test_a_late_arriver_its_peers_wait_most_of_the_slowdown_for_explains_it():
    # NCCL: peers wait at entry for a rank 10 ms late to each of 28 collectives a second (0.28), r = 20/14
    assert explains_slowdown(step(0.28, 0.28, 0.0), [2], 20 / 14)


def test_a_last_arriver_barely_waited_for_in_a_job_wide_slowdown_does_not():
    # a quota on every rank, iterations 1.5-2x as long; the rank that happened to arrive last leads by 0.06-0.13
    assert not explains_slowdown(step(0.059, 0.124, 0.116), [0], 1.57)
    assert not explains_slowdown(step(0.035, 0.173, 0.166), [0], 2.06)
    assert not explains_slowdown(step(0.184, 0.215, 0.096), [2], 1.5)
    assert not explains_slowdown(step(0.042, 0.179, 0.171), [0], 1.5)    # the closest: 0.40 of 1 - 1/r


def test_the_threshold_is_half_of_what_the_slowdown_could_make_peers_wait():
    # r = 2: a straggler could make its peers wait 0.5 of a window at entry; half of that is the line
    assert explains_slowdown(step(0.0, 0.26, 0.30), [0], 2.0)
    assert explains_slowdown(step(0.0, 0.24, 0.30), [0], 2.0)        # the median of two peers is their mean: 0.27
    assert not explains_slowdown(step(0.0, 0.20, 0.28), [0], 2.0)


def test_the_median_peer_decides_and_the_latest_of_the_rows_counts():
    # two late rows: the one that waits most is compared; one peer waiting long alone does not carry it
    assert not explains_slowdown(step(0.01, 0.20, 0.05, 0.9, 0.06), [0, 1], 1.6)
    assert explains_slowdown(step(0.01, 0.02, 0.5, 0.45, 0.6), [0, 1], 1.6)


def test_without_a_slowdown_or_wait_shares_there_is_nothing_to_decide_against():
    assert explains_slowdown(step(0.05, 0.06, 0.07), [0], 1.05)     # under MIN_SLOWDOWN
    assert explains_slowdown(step(0.05, 0.06, 0.07), [0], None)
    assert explains_slowdown(step(0.05, 0.06, 0.07), [0], math.nan)
    assert explains_slowdown([{}, {}, {}], [0], 2.0)                   # no wait shares
    assert explains_slowdown(step(0.05, None, None), [0], 2.0)        # one rank measured: nothing to compare
    assert explains_slowdown([{}, {ARRIVAL_WAIT: 0.3}, {ARRIVAL_WAIT: 0.3}], [0], 2.0)  # the late row unmeasured


def test_gloo_jobs_without_arrival_order_use_their_wait_probes():
    vectors = [{"torch_comm_wait_frac": w} for w in (0.02, 0.55, 0.6)]
    assert explains_slowdown(vectors, [0], 2.5)
    vectors = [{"torch_comm_wait_frac": w} for w in (0.02, 0.06, 0.08)]
    assert not explains_slowdown(vectors, [0], 2.5)
