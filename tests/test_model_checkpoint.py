"""Checkpoint in the middle of a stream: the restored model's later scores equal the
uninterrupted run's, bit for bit."""
from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest

from fleetscope.streams.model import JobModel, ModelConfig
from fleetscope.streams.model.checkpoint import MAGIC
from support.synthetic import SyntheticJob


def stream(n: int, seed: int = 0):
    job = SyntheticJob(seed=seed)
    out = []
    for w in range(n):
        f = np.ones((8, 30))
        if w >= 45:
            f[3, :6] = 0.8                                 # a fault in progress across the cut
        masked = {1: "host"} if w % 7 == 0 else None       # a source that comes and goes
        rows = job.window(f, masked)
        if w == 50:
            rows[0][1]["gpu.new_feature"] = 1.0            # a feature that appears mid-stream
        if w > 50:
            for _, feats in rows:
                feats["gpu.new_feature"] = 1.0 + 0.01 * w
        out.append((w * 1_000_000_000, rows))
    return out


@pytest.mark.parametrize("cfg", [
    ModelConfig(),                                         # all four detectors, hst included
    ModelConfig(covariance="full", detectors=("gmm", "peer", "mahalanobis")),
    ModelConfig(k=3, detectors=("gmm", "peer")),
], ids=["diag-all-detectors", "full", "fixed-k"])
def test_restore_mid_stream_gives_identical_scores(cfg):
    windows = stream(90)
    cut = 60                                  # past warm-up, during the fault, after new dims
    whole = JobModel(cfg)
    expected = [whole.process_window(t, rows) for t, rows in windows]
    first = JobModel(cfg)
    for t, rows in windows[:cut]:
        first.process_window(t, rows)
    assert first.admission.active              # the cut falls while the new feature waits to join
    blob = first.to_bytes()
    restored = JobModel.from_bytes(blob)
    got = [restored.process_window(t, rows) for t, rows in windows[cut:]]
    assert got == expected[cut:]
    assert any(s.is_anomaly for ws in got for s in ws)   # the comparison covers flagged windows
    assert restored.to_bytes() == whole.to_bytes()


def test_format_is_arrays_and_json_and_versioned():
    model = JobModel(ModelConfig(detectors=("gmm", "peer")))
    for t, rows in stream(40):
        model.process_window(t, rows)
    blob = model.to_bytes()
    assert blob.startswith(MAGIC)
    names = zipfile.ZipFile(io.BytesIO(blob[len(MAGIC):])).namelist()
    assert "meta.npy" in names and not any("pickle" in n for n in names)
    assert len(blob) < 64 * 1024
    with pytest.raises(ValueError, match="magic"):
        JobModel.from_bytes(b"garbage" + blob)
    import json
    with np.load(io.BytesIO(blob[len(MAGIC):])) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays["meta"].tobytes())
    meta["format"] = 99
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    buf = io.BytesIO()
    buf.write(MAGIC)
    np.savez(buf, **arrays)
    with pytest.raises(ValueError, match="format 99"):
        JobModel.from_bytes(buf.getvalue())


def test_a_replayed_window_is_scored_but_not_learned():
    windows = stream(50)
    a, b = JobModel(ModelConfig(detectors=("gmm", "peer"))), JobModel(ModelConfig(detectors=("gmm", "peer")))
    for t, rows in windows[:40]:
        a.process_window(t, rows)
        b.process_window(t, rows)
    replay = a.process_window(*windows[39])               # at-least-once delivery: window 39 again
    assert [s.score for s in replay] and a.stats["replayed_windows"] == 1
    for t, rows in windows[40:]:
        assert a.process_window(t, rows) == b.process_window(t, rows)
