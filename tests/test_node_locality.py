"""Naming the ranks a node's change lands on, from their own CPUs' interrupt work (streams/model/locality.py)."""
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


# The scorer end to end on the real chDB store, with the batches of tests/test_scoring_stream.py: node-a's
# host is flagged while its ranks are slow, but the work that slows them is NET_RX softirq on cpu0, where
# only rank 1 runs (as the dev scenario irq_storm pins it). No broker (producer=None), as there.

def softirq_on_cpu0(tick: int, flood: bool) -> list:
    """node-a's host rows (both CPUs and the total, seconds per state over the tick; cpu0 takes a NET_RX
    softirq flood while `flood`) and the /proc sampler's last-CPU row of its ranks: rank 1 on cpu0, its
    node-a peers on cpu1."""
    from test_scoring_stream import T0, TICK, rank_batch
    from fleetscope.schema import node_identity
    from fleetscope.wire import Batch, StrColumn
    import numpy as np

    ts = T0 + tick * TICK + TICK // 2
    scale = TICK / 1e9 / 0.5
    per_cpu = {"cpu0": {"user": 0.10, "softirq": 0.30 if flood else 0.002, "idle": 0.08 if flood else 0.38},
               "cpu1": {"user": 0.12, "softirq": 0.002, "idle": 0.36}}
    rows = [(f"cpu.{state}", cpu, seconds * scale) for cpu, states in per_cpu.items()
            for state, seconds in states.items()]
    rows += [(f"cpu.{state}", "all", sum(per_cpu[c][state] for c in per_cpu) * scale)
             for state in ("user", "softirq", "idle")]
    rows += [(f"cpu.{state}", dev, 0.0) for dev in ("all", "cpu0", "cpu1")
             for state in ("nice", "system", "iowait", "irq", "steal")]
    names, devices, values = zip(*rows)
    n = len(rows)
    out = [Batch("host", "node-a", {
        "ts_ns": np.full(n, ts, "<i8"), **node_identity("node-a", n), "metric": StrColumn.of(list(names)),
        "device": StrColumn.of(list(devices)), "value": np.array(values, "<f8"),
        "interval_ns": np.full(n, TICK, "<i8")}, created_ns=ts)]
    for rank in range(3):
        cpu = 0 if rank == 1 else 1
        out.append(rank_batch("proc", rank, ts, [("proc.last_cpu", f"cpu{cpu}", float(cpu), 0)]))
    return out


def irq_on_cpu0_batches(tick: int, rng):
    """node-a's ranks slow while node-a's host is flagged (tests/test_scoring_stream.noisy_node_batches)."""
    from test_scoring_stream import CONTENDED, noisy_node_batches

    out = [b for b in noisy_node_batches(tick, rng) if not (b.source == "host" and b.host == "node-a")]
    return out + softirq_on_cpu0(tick, tick // 2 in CONTENDED)


def irq_slows_the_job_batches(tick: int, rng):
    """Every rank's collective rate falls alike from ONSET (tests/test_scoring_stream.slow_job_batches), and
    the only thing that differs between the ranks is the softirq work on rank 1's CPU."""
    from test_scoring_stream import ONSET, slow_job_batches

    out = [b for b in slow_job_batches(tick, rng) if not (b.source == "host" and b.host == "node-a")]
    return out + softirq_on_cpu0(tick, tick // 2 >= ONSET)


def test_a_node_flagged_for_interrupt_work_on_one_ranks_cpu_names_that_rank_and_its_peers_wait(store, tmp_path):
    from test_scoring_stream import CONFIRM_LAG, CONTENDED, FakeClock, processor, roles_of, run
    import numpy as np

    proc = processor(store, tmp_path, FakeClock())
    run(proc, range(2 * 40), np.random.default_rng(13), [0], batches=irq_on_cpu0_batches)
    roles = roles_of(store)
    late = CONTENDED[CONFIRM_LAG:]
    rank1 = [roles.get((1, w)) for w in late]
    assert sum(r == (1, "culprit") for r in rank1) >= 0.8 * len(late), rank1
    for peer in (0, 2):
        peer_roles = [roles.get((peer, w)) for w in late]
        assert not any(r == (1, "node") or r == (1, "culprit") for r in peer_roles), (peer, peer_roles)
    assert proc.snapshot()["model_node_localised"] >= 0.8 * len(late)


def test_a_job_wide_slowdown_with_interrupt_work_on_one_ranks_cpu_names_that_rank_not_the_job(store, tmp_path):
    """The job's rate fell and no rank arrives clearly last; rank 1's CPU spends 60% of its time in softirq
    work and its peers' about none: rank 1 is the culprit, its peers wait, and no window gets role job."""
    from test_scoring_stream import CONFIRM_LAG, ONSET, FakeClock, processor, roles_of, run
    import numpy as np

    proc = processor(store, tmp_path, FakeClock())
    run(proc, range(2 * 40), np.random.default_rng(17), [0], batches=irq_slows_the_job_batches)
    roles = roles_of(store)
    slow = range(ONSET + CONFIRM_LAG, 39)
    assert sum(roles.get((1, w)) == (1, "culprit") for w in slow) >= 0.8 * len(slow), \
        [roles.get((1, w)) for w in slow]
    flagged = [(r, w, role) for (r, w), (a, role) in roles.items() if a and w in slow]
    assert not [f for f in flagged if f[2] in ("job", "node") or (f[0] != 1 and f[2] == "culprit")], flagged
    assert proc.snapshot()["model_job_named_by_locality"] >= 0.8 * len(slow)
