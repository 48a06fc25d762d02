"""A crashed rank is a loud failure named in the window it died in (streams/exit_features.py, streams/model/loud.py
``crashed``), and the peers its launcher stops or that die of it are not blamed.

The exit rows are the kernel tracer's (producers/tracers/kernel.py, ``kernel.process_exit``); here they are written
by the test into real windows (WindowAssembler), so the feature builders read them as the worker does."""
from __future__ import annotations

import time

import numpy as np
import pytest

from fleetscope.config import Config
from fleetscope.schema import SOURCE_COLUMNS, node_identity, validate
from fleetscope.streams.exit_features import exit_features, exit_verdict
from fleetscope.streams.model.loud import LoudFailures
from fleetscope.streams.model.roles import CULPRIT, WAITING
from fleetscope.streams.processor import MessageRef, StreamProcessor
from fleetscope.streams.windows import WindowAssembler
from fleetscope.wire import Batch, StrColumn, encode

SEC = 10**9
T0 = (time.time_ns() // SEC // 3600 - 24) * 3600 * SEC   # within the store's retention
JOB = ("acme", "train")
MEMBERS = [("node-a", 0), ("node-a", 1), ("node-a", 2)]


def kernel_window(devices: list[str]) -> dict[str, float]:
    """The features of one rank window holding these exit rows (and its usual off-CPU row)."""
    rows = [("kernel.offcpu_ns", "pid77", 1e6)] + [("kernel.process_exit", d, 1.0) for d in devices]
    n = len(rows)
    metric, device, value = zip(*rows)
    cols = {"ts_ns": np.full(n, T0 + SEC // 2, "<i8"), "tenant": StrColumn.constant("acme", n),
            "job": StrColumn.constant("train", n), "rank": np.full(n, 2, "<i4"), "pid": np.full(n, 77, "<i4"),
            "gpu": np.full(n, -1, "<i2"), "metric": StrColumn.of(metric), "device": StrColumn.of(device),
            "value": np.array(value, "<f8"), "interval_ns": np.full(n, SEC // 4, "<i8"),
            "sample_frac": np.ones(n, "<f8")}
    batch = Batch("kernel", "node-a", {k: cols[k] for k in SOURCE_COLUMNS["kernel"]}, created_ns=T0)
    validate(batch)
    w = WindowAssembler(window_s=1.0, allowed_lateness_s=0, idle_close_s=60)
    w.add(batch, None)
    (window,) = w.pop_closed(force=True)
    return exit_features(window)


@pytest.mark.parametrize("device, verdict", [
    ("signal:SIGKILL", (True, 9)), ("signal:SIGSEGV", (True, 11)), ("signal:SIGABRT", (True, 6)),
    ("exit:1", (True, 0)), ("exit:0", (False, 0)), ("signal:SIGTERM", (False, 15)), ("signal:SIGINT", (False, 2)),
    ("signal:SIGHUP", (False, 1)), ("signal:64", (True, 64)), ("signal:SIGNOPE", None), ("exit:x", None),
    ("pid77", None)])
def test_an_exit_is_a_crash_unless_it_finished_or_was_asked_to_stop(device, verdict):
    assert exit_verdict(device) == verdict


def test_a_window_with_a_killed_process_carries_the_crash_and_its_signal():
    assert kernel_window(["signal:SIGKILL"]) == {"process_exit_abnormal": 1.0, "process_exit_signal": 9.0}
    assert kernel_window(["exit:0", "signal:SIGTERM"]) == {}   # finished, and stopped by its launcher
    assert kernel_window([]) == {}


def _step(loud: LoudFailures, k: int, crashes: dict[int, float], members=MEMBERS):
    """Step k of the job; crashes: rank -> the signal that ended it (0: a non-zero exit)."""
    vectors = [{"offcpu_threads": 0.5, **({"process_exit_abnormal": 1.0, "process_exit_signal": crashes[r]}
                                          if r in crashes else {})} for _, r in members]
    return loud.step(JOB, T0 + k * SEC, members, vectors)


def test_the_first_crashed_rank_is_the_culprit_and_the_peers_that_die_of_it_wait():
    loud = LoudFailures()
    for k in range(5):
        assert _step(loud, k, {}) == []
    (flag,) = _step(loud, 5, {2: 9.0})                      # rank 2 SIGKILLed (the OOM killer)
    assert (flag.rank, flag.kind, flag.role) == (2, "crashed", CULPRIT)
    assert flag.features == {"rank_crashed": 1.0, "process_exit_signal": 9.0}
    # its peers lose their collective partner and exit 1 a window later: they died of it
    flags = _step(loud, 6, {0: 0.0, 1: 0.0}, MEMBERS[:2])
    assert [(f.rank, f.role) for f in flags] == [(0, WAITING), (1, WAITING)]
    assert loud.counts["crashed"] == 3


def test_in_one_window_the_killed_rank_is_the_culprit_and_the_ones_that_exited_wait():
    loud = LoudFailures()
    flags = _step(loud, 0, {0: 0.0, 2: 11.0})
    assert {f.rank: f.role for f in flags} == {0: WAITING, 2: CULPRIT}
    # no signal at all: every rank that crashed in the job's first crashed window is a culprit
    flags = _step(LoudFailures(), 0, {0: 0.0, 1: 0.0})
    assert {f.rank: f.role for f in flags} == {0: CULPRIT, 1: CULPRIT}


def test_a_crash_long_after_the_last_one_is_a_new_culprit():
    loud = LoudFailures(crash_collateral_s=10.0)
    assert _step(loud, 0, {1: 9.0})[0].role == CULPRIT
    assert _step(loud, 10, {0: 0.0})[0].role == WAITING      # within 10 s of the first
    assert _step(loud, 11, {2: 0.0})[0].role == CULPRIT      # a new incident


def test_a_crashed_rank_is_not_also_vanished_and_its_peers_silence_is_not_a_hang():
    loud = LoudFailures(vanish_windows=2, hang_windows=2, history=2)
    calling = {"torch_comm_waits_per_s": 10.0}
    for k in range(4):
        loud.step(JOB, T0 + k * SEC, MEMBERS, [dict(calling) for _ in MEMBERS])
    crash = loud.step(JOB, T0 + 4 * SEC, MEMBERS, [dict(calling), dict(calling),
                                                   {"process_exit_abnormal": 1.0, "process_exit_signal": 9.0}])
    assert [(f.rank, f.kind) for f in crash] == [(2, "crashed")]
    # the peers go on reporting, blocked in their collectives (no waits complete): neither vanished nor hung
    for k in range(5, 12):
        assert loud.step(JOB, T0 + k * SEC, MEMBERS[:2], [{"torch_comm_waits_per_s": 0.0}] * 2) == []
    # the rank restarts and reports again; if it then goes silent, it can vanish
    loud.step(JOB, T0 + 12 * SEC, MEMBERS, [dict(calling) for _ in MEMBERS])
    flags = [f for k in range(13, 16) for f in loud.step(JOB, T0 + k * SEC, MEMBERS[:2], [dict(calling)] * 2)]
    assert [(f.rank, f.kind) for f in flags] == [(2, "vanished")]


# -- end to end: the worker's real windows, features, scorer, KB and store (chDB) ---------------------------------
TICK = SEC // 2
RANKS, CRASH_AT, WINDOWS = 3, 20, 26


def rank_batch(source: str, rank: int, ts: int, rows) -> Batch:
    n = len(rows)
    metric, device, value, interval = zip(*rows)
    cols = {"ts_ns": np.full(n, ts, "<i8"), "tenant": StrColumn.constant("acme", n),
            "job": StrColumn.constant("train", n), "rank": np.full(n, rank, "<i4"),
            "pid": np.full(n, 1000 + rank, "<i4"), "gpu": np.full(n, -1, "<i2"),
            "metric": StrColumn.of(metric), "device": StrColumn.of(device), "value": np.array(value, "<f8"),
            "interval_ns": np.array(interval, "<i8"), "sample_frac": np.ones(n, "<f8")}
    batch = Batch(source, "node-a", {k: cols[k] for k in SOURCE_COLUMNS[source]}, created_ns=ts)
    validate(batch)
    return batch


def crash_job_batches(tick: int, rng) -> list[Batch]:
    """Three ranks stepping; rank 2 is SIGKILLed in window CRASH_AT, and torchrun stops the others with SIGTERM
    in the next window. The host's own sampler goes on (it moves the node's watermark, so windows close)."""
    window, ts = tick // 2, T0 + tick * TICK + TICK // 2
    out = []
    for r in range(RANKS):
        ends = CRASH_AT if r == 2 else CRASH_AT + 1
        if window > ends:
            continue
        noise = 1 + 0.03 * rng.standard_normal(3)
        rows = [("kernel.offcpu_ns", f"pid{1000 + r}", 0.2 * TICK * noise[0], TICK),
                ("kernel.ctx_switches", f"pid{1000 + r}", 400 * noise[1], TICK)]
        if window == ends and tick % 2 == 1:   # the tracer's tick after the process ended
            rows.append(("kernel.process_exit", "signal:SIGKILL" if r == 2 else "signal:SIGTERM", 1.0, TICK))
        out.append(rank_batch("kernel", r, ts, rows))
        if window < ends:
            out.append(rank_batch("proc", r, ts, [("proc.cpu_ns", f"pid{1000 + r}", 0.4 * TICK * noise[2], TICK)]))
    names = ("cpu.user", "cpu.system", "cpu.idle", "mem.total", "mem.available")
    cols = {"ts_ns": np.full(5, ts, "<i8"), **node_identity("node-a", 5), "metric": StrColumn.of(names),
            "device": StrColumn.constant("all", 5), "value": np.array((0.25, 0.05, 0.2, 1000.0, 600.0), "<f8"),
            "interval_ns": np.array([TICK] * 3 + [0, 0], "<i8")}
    out.append(Batch("host", "node-a", cols, created_ns=ts))
    return out


def test_a_killed_rank_is_alerted_in_the_window_it_died_and_the_ranks_its_launcher_stopped_are_not(store, tmp_path):
    # a dead rank sends nothing more, so its last windows close idle (idle_close_s of the worker's clock, here
    # the ticks' time) and the step goes on without it after step_hold_s
    cfg = Config(data_dir=tmp_path, window_s=1.0, allowed_lateness_s=0.5, idle_close_s=3, step_hold_s=2,
                 warmup_windows=10, model_checkpoint_s=0)
    now = [0.0]
    proc = StreamProcessor(cfg, store, clock=lambda: now[0])
    rng, offset = np.random.default_rng(5), 0
    for tick in range(2 * WINDOWS):
        now[0] = tick * TICK / SEC
        for batch in crash_job_batches(tick, rng):
            proc.handle(encode(batch), None, MessageRef("fleetscope.raw.x", 0, offset))
            offset += 1
        proc.flush()
    rows = store.query("SELECT rank, toUnixTimestamp64Milli(window_start), detectors, role FROM anomalies FINAL "
                       "WHERE has(detectors, 'crashed') OR has(detectors, 'vanished')").rows
    assert [(r, (ms * 10**6 - T0) // SEC, list(d), role) for r, ms, d, role in rows] == \
        [(2, CRASH_AT, ["crashed"], "culprit")], rows
    diag = store.query("SELECT kb_entry, evidence['process_exit_signal'] FROM diagnoses FINAL "
                       "WHERE rank = 2 AND has(detectors, 'crashed')").rows
    assert diag and diag[0] == ("crashed_rank", 9.0), diag
    assert proc.scorer.loud.counts["crashed"] == 1
