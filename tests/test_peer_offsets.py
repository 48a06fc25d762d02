"""Each rank's usual offset from its peers (streams/model/peers.py, RankOffsets) through the JobModel facade.

A rank that differs from its peers by design from the start (twice the batch, more threads) must stop
being flagged once the model is warm; a rank whose place among its peers changes mid-run (a straggler)
must still be flagged at once, and stay flagged; the learned offsets travel in the model's checkpoint.
Streams: tests/support/synthetic.py (8 ranks, 30 features, job-wide and per-rank correlated noise).
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from fleetscope.streams.model import JobModel, ModelConfig
from support.synthetic import SyntheticJob

CFG = ModelConfig(detectors=("gmm", "peer"))        # the default rule's detectors
PLAIN = ModelConfig(detectors=("gmm", "peer"), peer_offset_rate=0.0)   # no offsets: the old peer z
RECORDED = Path(__file__).parent / "recorded"
START = 80                                           # a mid-run change, well after the 30-window warm-up
ODD, SLOW = 2, 5                                     # the rank odd by design, the rank that becomes slow
BIG = [0, 1, 2, 3, 4, 5]                             # twice the work on these, from the first window


def by_design(f: np.ndarray) -> np.ndarray:
    f[ODD, BIG] = 2.0
    f[ODD, 12] = 1.3
    return f


def run(cfg: ModelConfig, n: int, seed: int, straggler: bool = False, model: JobModel | None = None,
        job: SyntheticJob | None = None, first: int = 0):
    job = job or SyntheticJob(seed=seed)
    model = model or JobModel(cfg)
    out = []
    for w in range(first, first + n):
        f = by_design(np.ones((8, 30)))
        if straggler and w >= START:
            f[SLOW, BIG] *= 0.85                         # 15% slower on six throughput features
        out.append(model.process_window(w * 1_000_000_000, job.window(f)))
    return out, model, job


def flags(windows, rank: int, lo: int, hi: int, detector: str = "peer") -> int:
    return sum(detector in windows[w][rank].detectors for w in range(lo, hi))


@pytest.mark.parametrize("seed", (0, 1, 2))
def test_a_rank_offset_from_the_start_stops_being_flagged_after_warm_up(seed):
    windows, _, _ = run(CFG, 150, seed)
    assert flags(windows, ODD, 30, 150) <= 2, [w for w in range(30, 150) if "peer" in windows[w][ODD].detectors]
    assert sum(windows[w][ODD].is_anomaly for w in range(30, 150)) <= 4
    # without offsets the same rank is flagged in nearly every window: the test can fail
    plain, _, _ = run(PLAIN, 150, seed)
    assert flags(plain, ODD, 30, 150) >= 110


@pytest.mark.parametrize("seed", (0, 1, 2))
def test_a_rank_that_slows_mid_run_is_still_flagged_within_a_few_windows_and_stays_flagged(seed):
    windows, _, _ = run(CFG, START + 40, seed, straggler=True)
    first = next((w - START for w in range(START, START + 40) if windows[w][SLOW].is_anomaly), None)
    assert first is not None and first <= 2
    # 40 windows on, it is not learned as its new normal
    assert flags(windows, SLOW, START, START + 40) >= 36
    assert set(windows[START + 30][SLOW].peer_z) & {f"gpu.f{j}" for j in BIG}
    # and the rank odd by design stays quiet meanwhile
    assert flags(windows, ODD, START, START + 40) <= 1


def test_a_rank_offset_by_design_that_changes_its_offset_is_flagged():
    """The offset is what is learned, not the rank: the odd rank slowing down further is a change."""
    job = SyntheticJob(seed=3)
    model = JobModel(CFG)
    hit = []
    for w in range(START + 10):
        f = by_design(np.ones((8, 30)))
        if w >= START:
            f[ODD, BIG] = 1.6                            # its batch got slower: 2.0 -> 1.6 of its peers
        hit.append("peer" in model.process_window(w * 1_000_000_000, job.window(f))[ODD].detectors)
    assert not any(hit[30:START]) and hit[START]


def test_the_learned_offsets_survive_a_checkpoint():
    """Saved after warm-up and restored: the same state, and the same scores afterwards as without the restart."""
    _, model, job = run(CFG, 60, seed=4)
    blob = model.to_bytes()
    restored = JobModel.from_bytes(blob)
    a, b = model.detectors["peer"].offsets, restored.detectors["peer"].offsets
    assert a.ranks == b.ranks and len(a.ranks) == 8
    for name in ("offset", "spread", "recent", "count"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert abs(a.offset[a.ranks[ODD], 0]) > 0            # something was learned: rank 2 runs twice f0
    after, _, _ = run(CFG, 40, 0, model=restored, job=job, first=60)
    assert flags(after, ODD, 0, 40) <= 1                 # restored, the odd rank stays quiet


def test_a_restored_model_scores_exactly_as_the_uninterrupted_one():
    job = SyntheticJob(seed=5)
    stream = []
    for w in range(100):
        f = by_design(np.ones((8, 30)))
        if w >= START:
            f[SLOW, BIG] *= 0.85
        stream.append(job.window(f))
    whole = JobModel(CFG)
    first = [whole.process_window(w * 10**9, rows) for w, rows in enumerate(stream)]
    part = JobModel(CFG)
    for w, rows in enumerate(stream[:50]):
        part.process_window(w * 10**9, rows)
    restored = JobModel.from_bytes(part.to_bytes())
    second = [restored.process_window(w * 10**9, rows) for w, rows in enumerate(stream[50:], start=50)]
    assert [[s.score for s in ws] for ws in first[50:]] == [[s.score for s in ws] for ws in second]
    assert [[(s.is_anomaly, s.detectors, s.peer_z) for s in ws] for ws in first[50:]] == \
        [[(s.is_anomaly, s.detectors, s.peer_z) for s in ws] for ws in second]
    assert any(s.is_anomaly for s in second[START - 50])


def test_a_checkpoint_from_before_the_offsets_still_loads_and_relearns_them():
    from fleetscope.streams.model import checkpoint, state_archive
    _, model, _ = run(CFG, 40, seed=6)
    meta, arrays = model.state()
    meta["detectors"]["peer"] = {}
    arrays = {k: v for k, v in arrays.items() if not k.startswith("det_peer/offset")}
    from dataclasses import asdict
    blob = state_archive.write({"format": checkpoint.FORMAT_VERSION, "config": asdict(model.config), "model": meta,
                                "parts": {}}, arrays)
    restored = JobModel.from_bytes(blob)
    assert restored.detectors["peer"].offsets.ranks == {}
    np.testing.assert_array_equal(restored.detectors["peer"].peers.typical, model.detectors["peer"].peers.typical)


@pytest.mark.parametrize("recording", ("dataloader_stall_rank_vectors_1.json.gz", "dataloader_stall_rank_vectors_2.json.gz"))
def test_a_stalled_rank_that_recovers_is_quiet_again_on_the_vectors_a_real_run_produced(recording):
    """Replayed: the rank vectors the worker built in a real dataloader_stall run (tests/recorded/, 3 gloo
    ranks, rank 1 reading 8 MiB per batch from disk, 30-60 s). Its peers wait for it, so most ranks are
    flagged and after regime_windows the job model learns the stall as a new regime, every window. Those
    windows made rank 1's own wobble on bytes read 600x larger, its offset followed the stall at that
    speed, and it was flagged for 15 windows after the stall, reading what its peers read (peer z -20).
    Each window now counts at most peers.SPREAD_CLIP of the wobble (recording 1). With that, in the next
    run the offset moved within the rank's own wobble (10 kB/s) while the peers' scale fell to 600 B/s, no
    rank reading anything, and it was flagged for 27 windows after (peer z -12): an offset now counts only
    beyond the rank's own wobble too (recording 2). In recording 2 the stall once did not become the regime:
    late torch features were admitted mid-stall, on the stall's scores, and the recalibrated thresholds unflagged
    the peers; late features now join on quiet windows only (feature_admission.py), so it does."""
    doc = json.loads(gzip.open(RECORDED / recording, "rt").read())
    model = JobModel(ModelConfig(warmup_windows=15, detectors=("gmm", "peer")))
    peer = {}
    for w in doc["windows"]:
        k = round(w["t_s"])
        for s in model.process_window(round((1000 + w["t_s"]) * 1e9), [(r, v) for r, v in w["ranks"]]):
            peer[s.rank, k] = "peer" in s.detectors
    assert model.stats["regime_windows_learned"] > 0      # the stall became the regime
    assert model.stats["admission_windows_skipped"] > 0    # ... and no late feature joined on its scores
    assert sum(peer.get((1, k), False) for k in range(31, 60)) >= 27
    after = [k for k in range(62, 90) if peer.get((1, k))]
    assert len(after) <= 1, after
