"""A hung collective names its culprit from the ranks' sampled Python stacks (streams/model/loud.py, hung;
streams/stack_signature.py).

A 3-rank NCCL job whose rank 1 stops calling collectives at window HUNG_AT while ranks 0 and 2 block in
theirs. No GPU here: the cuda and nccl rows are the rows those tracers send, written by this test; the
python_sampler rows are the rows producers/tracers/python_sampler.py sends at the end of each sampler
window (python.samples, and python.stack_top: its main thread's innermost "module:function" then), also
written here. Each rank reports a sampler window every 2 s, at ticks 1 mod 4. Through the real windows,
features, scorer, KB, store (chDB) and, for the culprit case, the embedded Kafka broker.
"""
from __future__ import annotations

import json
import time
import uuid

import numpy as np
import pytest

from fleetscope.config import Config
from fleetscope.schema import SOURCE_COLUMNS, node_identity, validate
from fleetscope.streams.model.loud import LoudFailures
from fleetscope.streams.processor import MessageRef, StreamProcessor
from fleetscope.streams.stack_signature import FEATURE, frame_id, model_input
from fleetscope.wire import Batch, StrColumn, encode

SEC = 10**9
TICK = SEC // 2
T0 = (time.time_ns() // SEC // 3600 - 24) * 3600 * SEC
RANKS, STUCK, HUNG_AT, WINDOWS = 3, 1, 24, 36
WAIT = "torch.distributed.distributed_c10d:all_reduce"
SAMPLER_TICKS = 4                      # a sampler window: 2 s
TRAIN = ("train:forward", "train:backward", "train:step")


def rank_batch(source: str, rank: int, ts: int, rows) -> Batch:
    n = len(rows)
    metric, device, value, interval = zip(*rows)
    cols = {"ts_ns": np.full(n, ts, "<i8"), "tenant": StrColumn.constant("acme", n),
            "job": StrColumn.constant("train", n), "rank": np.full(n, rank, "<i4"),
            "pid": np.full(n, 1000 + rank, "<i4"), "gpu": np.full(n, rank, "<i2"),
            "metric": StrColumn.of(metric), "device": StrColumn.of(device), "value": np.array(value, "<f8"),
            "interval_ns": np.array(interval, "<i8"), "sample_frac": np.ones(n, "<f8")}
    batch = Batch(source, "node-a", {k: cols[k] for k in SOURCE_COLUMNS[source]}, created_ns=ts)
    validate(batch)
    return batch


def host_batch(ts: int, rng) -> Batch:
    names = ("cpu.user", "cpu.system", "cpu.idle", "cpu.steal", "mem.total", "mem.available")
    vals = (0.25 * (1 + 0.03 * rng.standard_normal()), 0.05, 0.2, 0.0, 1000.0, 600.0)
    n = len(names)
    cols = {"ts_ns": np.full(n, ts, "<i8"), **node_identity("node-a", n), "metric": StrColumn.of(names),
            "device": StrColumn.constant("all", n), "value": np.array(vals, "<f8"),
            "interval_ns": np.array([TICK] * 4 + [0, 0], "<i8")}
    return Batch("host", "node-a", cols, created_ns=ts)


def sampler_rows(top: str) -> list[tuple]:
    """One sampler window's rows as PythonSampler._window_rows builds them (its shares left out): the main
    thread's innermost function at the window's end."""
    return [("python.samples", "all", 40, SAMPLER_TICKS * TICK), ("python.stack_top", top, 1.0, 0)]


def job_batches(tick: int, rng, hang_stacks) -> list[Batch]:
    """hang_stacks(rank) -> the function a rank's main thread is in while the job hangs (None: no dump)."""
    window = tick // 2
    ts = T0 + tick * TICK + TICK // 2
    out = []
    for r in range(RANKS):
        noise = 1 + 0.03 * rng.standard_normal(4)
        if window < HUNG_AT:   # the NCCL tracer reports a call when it returns: none once the job hangs
            dur = 0.3 * TICK * noise[0]
            out.append(rank_batch("nccl", r, ts, [
                ("nccl.calls", "AllReduce", 20, TICK), ("nccl.bytes", "AllReduce", 20 * 64e6, TICK),
                ("nccl.dur_ns", "AllReduce", dur, TICK), ("nccl.lat_p50_ns", "AllReduce", dur / 20 * noise[1], 0),
                ("nccl.lat_p99_ns", "AllReduce", 1.5 * dur / 20 * noise[2], 0)]))
        out.append(rank_batch("cuda", r, ts, [
            ("cuda.calls", "cudaLaunchKernel", 500 * noise[3], TICK),
            ("cuda.dur_ns", "cudaStreamSynchronize", 0.1 * TICK * noise[2], TICK)]))
        if tick % SAMPLER_TICKS == 1 and tick > SAMPLER_TICKS:
            # the dump at the sampler window's end: in the hang once it began, else wherever training is
            top = hang_stacks(r) if window >= HUNG_AT else TRAIN[(tick // SAMPLER_TICKS + r) % len(TRAIN)]
            if top is not None:
                out.append(rank_batch("python_sampler", r, ts, sampler_rows(top)))
    out.append(host_batch(ts, rng))
    return out


def run_job(store, tmp_path, hang_stacks, producer=None, **settings):
    cfg = Config(data_dir=tmp_path, window_s=1.0, allowed_lateness_s=0.5, idle_close_s=30, warmup_windows=10,
                 model_checkpoint_s=0, **settings)
    proc = StreamProcessor(cfg, store, producer=producer, clock=lambda: 0.0)
    rng, offset = np.random.default_rng(3), 0
    for tick in range(2 * WINDOWS):
        for batch in job_batches(tick, rng, hang_stacks):
            proc.handle(encode(batch), None, MessageRef("fleetscope.raw.x", 0, offset))
            offset += 1
        proc.flush()
    return proc


def hung_roles(store) -> dict[tuple[int, int], str]:
    rows = store.query("SELECT rank, toUnixTimestamp64Milli(window_start), detectors, role FROM anomalies FINAL").rows
    return {(r, (ms * 10**6 - T0) // SEC): role for r, ms, dets, role in rows if "hung" in dets}


def stuck_in_its_own_loop(rank: int) -> str:
    # the stuck rank sleeps in its own loop; the waiting ranks sit in the collective
    return "train:hang_while_set" if rank == STUCK else WAIT


def test_the_rank_whose_stack_differs_is_the_culprit_and_its_waiting_peers_are_not_alerted(store, tmp_path, broker):
    from confluent_kafka import Consumer, Producer, TopicPartition

    from fleetscope.topics import all_topics, ensure_topics

    prefix = f"h{uuid.uuid4().hex[:8]}"
    cfg_kw = {"topic_prefix": prefix, "partitions": 1}
    ensure_topics(broker.bootstrap, all_topics(Config(**cfg_kw)), 1)
    run_job(store, tmp_path, stuck_in_its_own_loop, producer=Producer({"bootstrap.servers": broker.bootstrap}),
            **cfg_kw)

    hung = hung_roles(store)
    windows = sorted({w for _, w in hung})
    # the stacks name the stuck rank in the first silent step (named_hang_windows, 1), before hang_windows (4)
    # would confirm an unexplained silence; to the last step closed (the last stays open)
    assert windows == list(range(HUNG_AT, WINDOWS - 1)), hung
    for w in windows:   # every hung step: the stuck rank the culprit, the others waiting on it
        assert {r: hung[(r, w)] for r in range(RANKS)} == {0: "waiting", 1: "culprit", 2: "waiting"}, hung

    consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": f"{prefix}-read",
                         "enable.auto.commit": False})
    consumer.assign([TopicPartition(f"{prefix}.anomalies", 0, 0), TopicPartition(f"{prefix}.diagnoses", 0, 0)])
    got: dict[str, list[dict]] = {"anomalies": [], "diagnoses": []}
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for m in consumer.consume(100, 0.5):
                if not m.error():
                    got[m.topic().rsplit(".", 1)[1]].append(json.loads(m.value()))
            hung_out = [a for a in got["anomalies"] if "hung" in a["detectors"]]
            hung_diag = [d for d in got["diagnoses"] if "hung" in d["detectors"]]
            if len(hung_out) >= len(windows) and len(hung_diag) >= len(windows):
                break
    finally:
        consumer.close()
    published = {(a["rank"], (a["window_start_ns"] - T0) // SEC, a["role"]) for a in got["anomalies"]
                 if "hung" in a["detectors"]}
    assert published == {(STUCK, w, "culprit") for w in windows}       # no waiting rank reaches the topic
    diagnosed = [d for d in got["diagnoses"] if "hung" in d["detectors"]]
    assert {(d["rank"], (d["window_start_ns"] - T0) // SEC) for d in diagnosed} == {(STUCK, w) for w in windows}
    for d in diagnosed:
        assert d["culprit_ranks"] == [STUCK], d
        assert d["matches"][0]["kb_entry"] == "hung_collective", d["matches"]


@pytest.mark.parametrize("case, hang_stacks", [
    ("no sampler", lambda r: None),
    ("one rank without a signature", lambda r: None if r == 2 else stuck_in_its_own_loop(r)),
    ("every rank alike", lambda r: WAIT),
    ("no majority", lambda r: (WAIT, "train:hang_while_set", "train:load")[r]),
])
def test_without_a_strict_minority_of_stacks_every_hung_rank_stays_the_jobs(store, tmp_path, case, hang_stacks):
    run_job(store, tmp_path, hang_stacks)
    hung = hung_roles(store)
    assert hung and {r for r, _ in hung} == set(range(RANKS)), (case, hung)
    assert set(hung.values()) == {"job"}, (case, hung)
    assert min(w for _, w in hung) == HUNG_AT + 3, (case, hung)   # unexplained: only hang_windows' silence


def test_a_hang_its_stacks_name_is_alerted_in_its_first_silent_step_and_one_they_do_not_after_hang_windows():
    members = [("node-a", r) for r in range(3)]
    busy = {"nccl_calls_per_s": 10.0}
    wait, stuck = frame_id(WAIT), frame_id("train:hang_while_set")
    for stacks, first in (((wait, stuck, wait), 1), ((wait, wait, wait), 4)):
        loud, job = LoudFailures(history=2, hang_windows=4), ("acme", "train")
        for k in range(3):
            assert loud.step(job, k, members, [dict(busy) for _ in members]) == []
        flagged = []
        for k in range(1, 6):
            flags = loud.step(job, 2 + k, members, [{FEATURE: s} for s in stacks])
            flagged += [k] if flags else []
        assert flagged[0] == first and flagged == list(range(first, 6)), (stacks, flagged)
    loud = LoudFailures(history=2, hang_windows=4, named_hang_windows=2)   # named_hang_windows is a setting
    for k in range(3):
        loud.step(("a", "j"), k, members, [dict(busy) for _ in members])
    assert loud.step(("a", "j"), 3, members, [{FEATURE: s} for s in (wait, stuck, wait)]) == []
    assert [f.role for f in loud.step(("a", "j"), 4, members, [{FEATURE: s} for s in (wait, stuck, wait)])] == \
        ["waiting", "culprit", "waiting"]


def test_only_signatures_read_inside_the_silence_count():
    """A rank's signature from before the hang (its last training stack) says nothing about the hang."""
    loud, job = LoudFailures(history=1, hang_windows=2), ("acme", "train")
    members = [("node-a", r) for r in range(3)]
    busy = {"nccl_calls_per_s": 10.0}
    loud.step(job, 1, members, [dict(busy, **{FEATURE: frame_id("train:forward")}) for _ in members])
    before = [{FEATURE: frame_id("train:step")}, {}, {}]      # rank 0 differs, but in the last window before
    assert loud.step(job, 2, members, [dict(busy, **before[0]), busy, busy]) == []
    silent = [{}, {FEATURE: frame_id("train:hang_while_set")}, {FEATURE: frame_id("torch.distributed.distributed_c10d:all_reduce")}]
    loud.step(job, 3, members, silent)
    flags = loud.step(job, 4, members, [{}, {}, {FEATURE: frame_id("torch.distributed.distributed_c10d:all_reduce")}])
    assert [f.role for f in flags] == ["job"] * 3    # rank 0 has no signature inside the silence
    flags = loud.step(job, 5, members, [{FEATURE: frame_id("torch.distributed.distributed_c10d:all_reduce")}, {}, {}])
    assert [(f.rank, f.role) for f in flags] == [(0, "waiting"), (1, "culprit"), (2, "waiting")]
    # the calls return: the next silence starts without signatures
    loud.step(job, 6, members, [busy] * 3)
    loud.step(job, 7, members, [{}] * 3)
    assert [f.role for f in loud.step(job, 8, members, [{}] * 3)] == ["job"] * 3


def test_the_id_is_a_category_the_model_never_sees():
    assert frame_id("train:forward") == frame_id("train:forward") != frame_id("train:backward")
    assert model_input({FEATURE: 1.0, "nccl_calls_per_s": 2.0}) == {"nccl_calls_per_s": 2.0}


def test_a_gloo_job_whose_waits_the_governor_detaches_still_hangs_on_its_collectives_issued():
    """gloo's waits are duty-cycled (producers/tracers/torch_ops.py): in most windows a rank reports only the
    always-on marks' ``torch_collectives_per_s``, a measured 0 once it issues none. Windows with waits and
    windows without them read alike, so a job whose ranks all stop issuing collectives is hung after
    hang_windows, and a calling job with its waits detached is not."""
    members = [("node-a", r) for r in range(3)]
    loud = LoudFailures(hang_windows=3, history=3)
    job = ("acme", "gloo")
    for k in range(8):   # calling; the waits attached every other window
        v = {"torch_collectives_per_s": 60.0, **({"torch_comm_waits_per_s": 900.0} if k % 2 else {})}
        assert loud.step(job, T0 + k * SEC, members, [dict(v) for _ in members]) == []
    flags = []
    for k in range(8, 12):   # none issues a collective any more, waits attached or not
        v = {"torch_collectives_per_s": 0.0, **({"torch_comm_waits_per_s": 0.0} if k % 2 else {})}
        flags.append(loud.step(job, T0 + k * SEC, members, [dict(v) for _ in members]))
    assert [len(f) for f in flags] == [0, 0, 3, 3]
    assert {(f.rank, f.kind) for f in flags[2]} == {(0, "hung"), (1, "hung"), (2, "hung")}


def test_the_step_a_hang_ends_in_keeps_its_roles_and_the_next_one_is_the_job_s_again():
    """Calls return part-way through a step: the job ran slower in it because of the hang, so its ranks keep the
    hang's roles there rather than a new job-wide change's (role job for every rank, the waiting ones too)."""
    members = [("node-a", r) for r in range(3)]
    busy = {"nccl_calls_per_s": 10.0}
    wait, stuck = frame_id(WAIT), frame_id("train:hang_while_set")
    loud, job = LoudFailures(history=2, hang_windows=4), ("acme", "train")
    for k in range(3):
        loud.step(job, k, members, [dict(busy) for _ in members])
    for k in range(3, 6):
        assert len(loud.step(job, k, members, [{FEATURE: s} for s in (wait, stuck, wait)])) == 3
    ended = loud.step(job, 6, members, [{"nccl_calls_per_s": 4.0} for _ in members])
    assert [(f.rank, f.kind, f.role) for f in ended] == [(0, "hung", "waiting"), (1, "hung", "culprit"),
                                                       (2, "hung", "waiting")]
    assert loud.step(job, 7, members, [dict(busy) for _ in members]) == []
    # a silence never flagged leaves nothing behind when its calls return
    for k in range(8, 10):
        assert loud.step(job, k, members, [{FEATURE: wait} for _ in members]) == []
    assert loud.step(job, 10, members, [dict(busy) for _ in members]) == []
