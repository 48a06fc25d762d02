"""Who arrives last at each collective: the communicators' sequence numbers compared across a job's ranks.

The first test is real end to end but for the GPU: two rank processes of the GPU-job stand-in (libcudart and
libnccl are src/fleetscope/eval/gpu_stub's stand-ins; no GPU or NCCL here) all-reduce over loopback TCP, so a
rank that reaches its collective late holds its peer up inside the call. Real: the processes, the NCCL tracer's
uprobes and maps (each communicator's sequence and marked entry times), the identity resolver reading the ranks'
environment, the fault knob, the worker's windows and features, the arrival comparison and the roles.

The second is the same for a CPU job: three ranks of the scenarios' DDP workload (real PyTorch, real gloo over
loopback, under torchrun), one of them sleeping longer before each step by design, traced by the real torch
tracer, whose gloo arrival marks (ProcessGroupGloo::nextTag) feed the same comparison.

The third checks how the comparison joins ranks whose samples fall in different windows, on batches built by
the tracers' own row path (rows.metric_batch), since the moment an agent samples cannot be set on a real one.
"""
import json
import os
import time

import pytest

from fleetscope.eval.faults import WorkloadKnob
from fleetscope.eval.workloads.gpu_standin import StandinConfig, build, launch
from fleetscope.producers.tracers.rows import RowIdentity, metric_batch
from fleetscope.streams.arrival import ArrivalOrder
from fleetscope.streams.features import window_features
from fleetscope.streams.model.roles import CULPRIT, WAITING, assign_roles, last_arrivers
from fleetscope.streams.windows import WindowAssembler

CFG = StandinConfig(batch_mb=4, kernels=8, kernel_us=500, grad_mb=0.5, step_sleep_ms=20)
STALL_MS = 30
PHASE_S = 2.5
SETTLE_S = 0.5  # the knob watcher and the stand-ins each re-read their files within 100 ms


def _windows(batches):
    assembler = WindowAssembler(window_s=1.0, allowed_lateness_s=0, idle_close_s=60)
    for b in batches:
        assembler.add(b, None)
    windows = assembler.pop_closed(force=True)
    vectors = [window_features(w) for w in windows]
    order = ArrivalOrder()
    order.add(windows, vectors)
    return windows, vectors, order


def _steps(windows, vectors, t0_ns, t1_ns):
    """rank -> vector, for each step wholly inside [t0, t1) that both ranks reported with arrival features."""
    steps = {}
    for w, v in zip(windows, vectors):
        if w.start_ns >= t0_ns and w.end_ns <= t1_ns and "arrival_lag_s" in v:
            steps.setdefault(w.start_ns, {})[w.key[3]] = v
    return [s for s in steps.values() if set(s) == {0, 1}]


@pytest.mark.skipif(os.geteuid() != 0, reason="loading BPF programs needs root (CI runs as root)")
def test_the_rank_that_reaches_its_collectives_late_is_the_culprit_and_its_peer_waits(tmp_path):
    from fleetscope.producers.identity import IdentityResolver
    from fleetscope.producers.tracers.nccl import NcclTracer
    control = tmp_path / "control"
    control.mkdir()
    run = launch(2, env={"FLEETSCOPE_WORKLOAD_CONTROL_DIR": str(control), "FLEETSCOPE_JOB": "arrival-test"},
                 cfg=CFG, duration_s=60, bindir=build(tmp_path / "bin"), wait_for_go=True)
    stall = WorkloadKnob("memcpy_stall", control, 1, 1.0, {"extra_ms": STALL_MS})
    tracer = NcclTracer("node-a", resolver=IdentityResolver(host="node-a"))
    batches = []

    def sample_for(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.25)
            batches.append(tracer.sample())

    try:
        for pid in run.rank_pids(timeout_s=30).values():
            assert tracer.add_pid(pid)  # before the ranks' ncclCommInitRank: their sequences count from it
        run.go()
        healthy_t0 = time.time_ns()
        sample_for(PHASE_S)
        with stall:
            stalled_t0 = time.time_ns()
            sample_for(PHASE_S + SETTLE_S)
            stalled_t1 = time.time_ns()
        batches.append(tracer.sample())
    finally:
        stall.stop()
        run.cleanup()
        tracer.close()

    windows, vectors, order = _windows([b for b in batches if b is not None])
    assert order.compared >= 20, (order.compared, order.single)
    healthy = _steps(windows, vectors, healthy_t0, stalled_t0)
    stalled = _steps(windows, vectors, stalled_t0 + int(SETTLE_S * 1e9), stalled_t1)
    assert healthy and stalled, (len(healthy), len(stalled))

    def lag_ms(step, rank):
        return step[rank]["arrival_lag_s"] * 1e3

    # healthy: the ring keeps the ranks in step, so neither arrives far behind the other
    for step in healthy:
        assert max(lag_ms(step, 0), lag_ms(step, 1)) < STALL_MS / 3, [(lag_ms(s, 0), lag_ms(s, 1)) for s in healthy]
    # rank 1's copy before each all-reduce takes STALL_MS longer: it enters each collective that much after rank 0
    for step in stalled:
        assert lag_ms(step, 1) > 0.6 * STALL_MS and lag_ms(step, 0) < STALL_MS / 3, (lag_ms(step, 0), lag_ms(step, 1))
        assert step[0]["arrival_wait_frac"] > 0.2 > step[1]["arrival_wait_frac"], step
        # both ranks look slow to a model (each step takes longer); the order of arrival names the culprit
        roles = assign_roles([0, 1], [step[0], step[1]], [True, True])
        assert roles.wait_feature == "arrival_wait_frac"
        assert roles.roles == [WAITING, CULPRIT] and roles.culprit_ranks == [1]
        # a job-wide change with no rank flagged by its model is still rank 1's doing
        assert last_arrivers([step[0], step[1]]) == [1]
    # healthy steps name no last arriver; beside one busy loop per core, one step in a loaded CI run had a rank enter
    # a scheduling quantum behind (the rule is read only in a step whose job's rate already fell)
    named = [step for step in healthy if last_arrivers([step[0], step[1]]) is not None]
    assert len(named) <= max(1, len(healthy) // 10), (len(named), len(healthy), named)


GLOO_SLEEP_MS, GLOO_EXTRA_MS = 20, 60


@pytest.mark.skipif(os.geteuid() != 0, reason="loading BPF programs needs root (CI runs as root)")
def test_the_gloo_rank_that_issues_its_collectives_late_is_the_culprit_and_its_peers_wait(tmp_path):
    from fleetscope.eval.workloads.launch import DEBIAN_PYTHON, launch, venv_site_packages
    from fleetscope.producers.identity import IdentityResolver
    from fleetscope.producers.tracers.torch_ops import TorchTracer
    slow = {"1": {"sleep_ms": GLOO_SLEEP_MS + GLOO_EXTRA_MS}}
    progress = tmp_path / "progress"
    progress.mkdir()
    run = launch(3, ["--duration-s", "90", "--sleep-ms", str(GLOO_SLEEP_MS), "--rank-args", json.dumps(slow)],
                 python=DEBIAN_PYTHON, site_packages=venv_site_packages(), run_id="gloo-arrival",
                 env={"FLEETSCOPE_WORKLOAD_PROGRESS_DIR": str(progress)}, log_path=tmp_path / "workload.log")
    tracer = TorchTracer("node-a", resolver=IdentityResolver(host="node-a"), ops=frozenset())
    batches = []
    try:
        pids = run.rank_pids(timeout_s=120)
        deadline = time.monotonic() + 120
        for pid in pids.values():  # libtorch_cpu is mapped once the rank has imported torch
            while not tracer.add_pid(pid):
                assert time.monotonic() < deadline, tracer.unavailable.get(pid)
                time.sleep(0.2)
        while not all(_steps_done(progress / f"progress-rank{r}.jsonl") >= 3 for r in range(3)):
            assert time.monotonic() < deadline, "the ranks did not start training"  # DDP's setup is over
            time.sleep(0.2)
        tracer.sample()
        t0 = time.time_ns()
        while time.time_ns() - t0 < 6 * 10**9:
            time.sleep(0.25)
            batches.append(tracer.sample())
        t1 = time.time_ns()
    finally:
        run.stop()
        tracer.close()
    windows, vectors, order = _windows([b for b in batches if b is not None])
    steps = {}
    for w, v in zip(windows, vectors):
        if w.key[1] == "gloo-arrival" and w.start_ns >= t0 and w.end_ns <= t1 and "arrival_lag_s" in v:
            steps.setdefault(w.start_ns, {})[w.key[3]] = v
    steps = [s for s in steps.values() if set(s) == {0, 1, 2}]
    assert len(steps) >= 3 and order.compared >= 20, (len(steps), order.compared, order.single)
    for step in steps:
        lag_ms = {r: step[r]["arrival_lag_s"] * 1e3 for r in step}
        # rank 1 sleeps GLOO_EXTRA_MS longer before each step, so it issues the step's first collective (the
        # workload's loop check, all_ranks_past: a synchronous all_reduce right after the sleep) that much later
        # than its peers (measured: 60 ms). That all_reduce brings the ranks back in step, so DDP's gradient
        # all-reduce after it is issued alike on all (measured: < 1 ms apart); the mean lag is about half.
        assert lag_ms[1] > 0.35 * GLOO_EXTRA_MS and max(lag_ms[0], lag_ms[2]) < GLOO_EXTRA_MS / 10, lag_ms
        assert min(step[0]["arrival_wait_frac"], step[2]["arrival_wait_frac"]) > 0.2 > step[1]["arrival_wait_frac"]
        roles = assign_roles([0, 1, 2], [step[0], step[1], step[2]], [True, True, True])
        assert roles.wait_feature == "arrival_wait_frac"
        assert roles.roles == [WAITING, CULPRIT, WAITING] and roles.culprit_ranks == [1]
        assert last_arrivers([step[0], step[1], step[2]]) == [1]
        # the job's collective rate (model/job_rate.py) from the always-on marks: every rank of a synchronous
        # job issues the same collectives, two a step here
        rates = [step[r]["torch_collectives_per_s"] for r in (0, 1, 2)]
        assert min(rates) > 0 and max(rates) < 1.5 * min(rates) + 4, rates


def _steps_done(progress_file) -> int:
    """The newest step count a rank of the DDP workload wrote (its progress lines), 0 before its first."""
    try:
        lines = progress_file.read_text().splitlines()
    except FileNotFoundError:
        return 0
    return json.loads(lines[-1])["steps"] if lines else 0


def _mark_batch(now_ns, marks_by_rank):
    """The NCCL tracer's marks of one sample, as its own row path makes them: rank -> {seq: entry ns}."""
    rows = [("nccl.coll_entry_ns", f"{'ab' * 8}#{seq}", ts, 100 + rank, 0, 1.0)
            for rank, marks in marks_by_rank.items() for seq, ts in marks.items()]
    rows += [("nccl.calls", "AllReduce", 10, 100 + rank) for rank in marks_by_rank]
    return metric_batch("nccl", "node-a", rows, now_ns, 10**9,
                        lambda pid: RowIdentity("t", "job", pid - 100, pid - 100))


def test_a_collective_waits_one_step_for_ranks_that_report_it_later_then_is_compared_with_whoever_did():
    base = 1_700_000_000 * 10**9  # entry times travel as float64 epoch ns: exact to 256 ns
    ms = 10**6
    batches = [
        # step 0: rank 0 has entered collectives 1-3; rank 1's sample came before it entered 3
        _mark_batch(base + 900 * ms, {0: {1: base + 100 * ms, 2: base + 400 * ms, 3: base + 800 * ms},
                                      1: {1: base + 110 * ms, 2: base + 450 * ms}}),
        # step 1: rank 1 reports 3 (late by 50 ms) and 4; rank 0 never reports 4
        _mark_batch(base + 1900 * ms, {0: {}, 1: {3: base + 850 * ms, 4: base + 1500 * ms}}),
        _mark_batch(base + 2900 * ms, {0: {}, 1: {}}),
    ]
    windows, vectors, order = _windows(batches)
    by = {(w.start_ns - base) // 10**9 * 10 + w.key[3]: v for w, v in zip(windows, vectors)}
    # step 0 compares 1 and 2; 3 waits for rank 1
    assert by[0]["arrival_lag_s"] == pytest.approx(0.0, abs=1e-6)
    assert by[1]["arrival_lag_s"] == pytest.approx((0.010 + 0.050) / 2, abs=1e-6)
    assert by[0]["arrival_wait_frac"] == pytest.approx((0.010 + 0.050) / 2 * 10, abs=1e-5)
    # step 1 compares 3 (rank 1 late by 50 ms); 4 waits a step for rank 0, which never reports it
    assert by[11]["arrival_lag_s"] == pytest.approx(0.050, abs=1e-6)
    assert by[10]["arrival_wait_frac"] == pytest.approx(0.050 * 10, abs=1e-5)
    assert "arrival_lag_s" not in by[21]  # 4 had one rank only: nothing to compare
    assert (order.compared, order.single, order.open_collectives()) == (3, 1, 0)
