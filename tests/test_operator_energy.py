"""Energy per operator (streams/energy_features.py) through the real worker core and chDB, and
`fleetscope energy diff` on what it stored.

Stand-in: the rows a rank's NVML sampler (per-process energy and SM utilization), torch tracer
(torch.ops, torch.op_ns per op) and NCCL tracer (collective calls) would send, written here, since
this machine has no GPU. Real: the StreamProcessor (windows, features, the energy batch on
<prefix>.features), the sink's TopicWriter, migration 010 in chDB, and the diff's queries.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from fleetscope.cli.energy import EnergyDiffError, energy_diff, format_diff
from fleetscope.cli.main import main
from fleetscope.config import Config
from fleetscope.wire import Batch, StrColumn, encode
from fleetscope.streams.energy_features import IDLE, OTHER, split_energy
from fleetscope.streams.processor import MessageRef, StreamProcessor

SEC = 10**9
HOUR = 3600 * SEC
T0 = (time.time_ns() // HOUR - 2) * HOUR
TICK = SEC // 2
STEPS_PER_TICK = 5  # one all-reduce per step


def rank_batches(job: str, rank: int, ts: int, op_ms: dict[str, float], watts: float, sm_util: float):
    """One tick of one rank: its GPU energy share and SM utilization (nvml), op time and calls (torch),
    one all-reduce per step (nccl)."""
    def batch(source, rows):
        n = len(rows)
        metric, device, value, interval = zip(*rows)
        cols = {"ts_ns": np.full(n, ts, "<i8"), "tenant": StrColumn.constant("t", n),
                "job": StrColumn.constant(job, n), "rank": np.full(n, rank, "<i4"),
                "pid": np.full(n, 100 + rank, "<i4"), "gpu": np.full(n, rank, "<i2"),
                "metric": StrColumn.of(metric), "device": StrColumn.of(device), "value": np.array(value, "<f8"),
                "interval_ns": np.array(interval, "<i8")}
        if source != "nvml":
            cols["sample_frac"] = np.ones(n, "<f8")
        return Batch(source, "node-a", cols, created_ns=ts)

    gpu = f"gpu{rank}"
    nvml = batch("nvml", [("nvml.proc_energy_j", gpu, watts * TICK / SEC, TICK), ("nvml.proc_sm_util", gpu, sm_util, 0)])
    torch = batch("torch", [row for op, ms in op_ms.items() for row in (
        ("torch.op_ns", op, ms * 1e6 * STEPS_PER_TICK, TICK), ("torch.ops", op, STEPS_PER_TICK, TICK))])
    nccl = batch("nccl", [("nccl.calls", "AllReduce", STEPS_PER_TICK, TICK), ("nccl.bytes", "AllReduce", 1e6, TICK),
                          ("nccl.dur_ns", "AllReduce", 1e6, TICK)])
    return [nvml, torch, nccl]


def run_job(store, tmp_path, job: str, op_ms: dict[str, float], watts: float, ticks: int = 10) -> StreamProcessor:
    cfg = Config(data_dir=tmp_path, window_s=1.0, allowed_lateness_s=0.5, idle_close_s=30)
    proc = StreamProcessor(cfg, store, producer=None, clock=time.monotonic, scoring=False)
    offset = 0
    for k in range(ticks):
        for rank in (0, 1):
            for b in rank_batches(job, rank, T0 + (k + 1) * TICK - 1, op_ms, watts, sm_util=80.0):
                proc.handle(encode(b), None, MessageRef(f"fleetscope.raw.{b.source}", 0, offset))
                offset += 1
    proc.flush(force=True)
    return proc


BASE = {"aten::mm": 4.0, "aten::relu": 2.0, "aten::softmax": 2.0}


def test_split_gives_the_busy_energy_by_weight_and_the_rest_to_idle():
    rows = split_energy(100.0, {"mm": 3.0, "relu": 1.0}, busy=0.8)
    assert [(op, round(j, 6)) for op, _, _, j in rows] == [("mm", 60.0), ("relu", 20.0), (IDLE, 20.0)]
    assert sum(share for _, _, share, _ in rows) == pytest.approx(1.0)
    capped = split_energy(10.0, {f"op{i}": float(i + 1) for i in range(5)}, busy=None, cap=2)
    assert [op for op, *_ in capped] == ["op4", "op3", OTHER]
    assert capped[-1][3] == pytest.approx(10.0 * 6 / 15)  # op0..op2 weigh 1+2+3 of 15
    assert split_energy(5.0, {}, busy=0.5) == []


def test_energy_per_operator_is_stored_per_rank_window_and_sums_to_the_rank_energy(store, tmp_path):
    run_job(store, tmp_path, "base", BASE, watts=200.0)
    rows = store.query("SELECT rank, toUnixTimestamp64Milli(window_start), basis, operator, energy_j, share, "
                       "collectives, ops FROM operator_energy FINAL ORDER BY rank, window_start, operator").rows
    windows = {(r[0], r[1]) for r in rows}
    assert len(windows) >= 8 and {r[2] for r in rows} == {"torch"}
    for rank, start in windows:
        mine = {r[3]: r for r in rows if (r[0], r[1]) == (rank, start)}
        assert set(mine) == {"aten::mm", "aten::relu", "aten::softmax", IDLE}
        assert sum(r[4] for r in mine.values()) == pytest.approx(200.0)   # two 0.5 s ticks at 200 W
        assert mine[IDLE][4] == pytest.approx(40.0)                        # 20% of the time no kernel ran
        assert mine["aten::mm"][4] == pytest.approx(160.0 * 4 / 8)         # mm: 4 of 8 ms busy per step
        assert mine["aten::mm"][6] == 2 * STEPS_PER_TICK and mine["aten::mm"][7] == 3 * 2 * STEPS_PER_TICK
    # the energy rows did not become feature rows
    assert store.query("SELECT count() FROM features FINAL WHERE job = 'base'").rows[0][0] == len(windows)


def test_energy_diff_names_the_operator_that_got_dearer_first(store, tmp_path, capsys):
    # B: the same steps, its matmul takes 3x as long (e.g. a slower kernel or a worse shape) and the GPU draws
    # the energy of the extra busy time: (4*3 + 2 + 2) / 8 of the baseline power at equal utilization
    run_job(store, tmp_path, "base", BASE, watts=200.0)
    run_job(store, tmp_path, "slow-mm", {**BASE, "aten::mm": 12.0}, watts=200.0 * 16 / 8)
    d = energy_diff(store, "base", "slow-mm", per="step")
    assert d.operators[0].operator == "aten::mm"
    assert d.operators[0].excess > 0 and d.total_b > d.total_a
    # per step (one all-reduce per rank): A draws 200 W per rank, 2 ranks, 10 steps/s -> 40 J per step of the
    # job, 80% of it busy, mm 4/8 of that; B 80 J per step, mm 12/16 of the busy 80%
    assert d.total_a == pytest.approx(200.0 * 2 / 10)
    assert d.operators[0].a == pytest.approx(0.8 * 0.5 * 40.0) and d.operators[0].b == pytest.approx(0.8 * 0.75 * 80.0)
    assert "steps, counted as NCCL collective calls per rank" in d.work_unit
    text = format_diff(d)
    assert text.index("aten::mm") < text.index("aten::relu")
    # the CLI prints the same, and refuses --per token without a step size, in one line
    assert main(["--config", str(_config_file(tmp_path)), "energy", "diff", "--job", "base", "--job", "slow-mm"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[5].split()[0] == "aten::mm"
    assert main(["--config", str(_config_file(tmp_path)), "energy", "diff", "--job", "base", "--job", "slow-mm",
                 "--per", "token"]) == 1
    assert "--step-size" in capsys.readouterr().err
    with pytest.raises(EnergyDiffError, match="no energy per operator stored for job 'nope'"):
        energy_diff(store, "base", "nope")


def _config_file(tmp_path):
    path = tmp_path / "fleetscope.toml"
    path.write_text(f'data_dir = "{tmp_path}"\n')
    return path


def test_per_collective_settings_are_ratios_of_totals_when_a_window_has_collectives_and_no_ops(store, tmp_path):
    """A job's last window holds one tick's all-reduces and no torch ops (as a partial window at a run's edge
    does): ops per collective is every op over every collective, not a mean over the windows with ops divided
    by a mean over the windows with collectives (150/55 = 2.73, where that gives 30 / (55/6) = 3.27)."""
    from fleetscope.cli.energy import job_settings
    proc = run_job(store, tmp_path, "edge", BASE, watts=200.0)  # 5 windows: 30 ops and 10 all-reduces each, per rank
    for rank in (0, 1):
        nccl_only = rank_batches("edge", rank, T0 + 6 * SEC + TICK, BASE, 200.0, sm_util=80.0)[2]
        proc.handle(encode(nccl_only), None, MessageRef("fleetscope.raw.nccl", 0, 100 + rank))
    proc.flush(force=True)
    settings = job_settings(store, "t", "edge")
    assert settings["windows"] == 12
    assert settings["torch ops per collective"] == pytest.approx(150 / 55)
