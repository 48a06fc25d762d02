"""Versioned, compact checkpoint of a JobModel: numpy arrays + JSON, no pickle of our objects.

Layout: MAGIC (8 bytes) then an uncompressed .npz archive. Entry "meta" holds
the JSON (format version, config, feature names, counters, scalars such as
the random generators' states); every other entry is one array, named
"<part>/<name>". Loading uses allow_pickle=False. The one exception is the
optional river HalfSpaceTrees detector, whose trees are stored as a pickle
inside the array "hst/river_pickle" (river has no other way to save them).

Restoring gives bit-identical state (arrays are stored as they are, floats
in JSON round-trip exactly), so later scores equal an uninterrupted run.
"""
from __future__ import annotations

import io
import json
from dataclasses import asdict

import numpy as np

from fleetscope.streams.model.config import ModelConfig
from fleetscope.streams.model.feature_index import FeatureIndex

MAGIC = b"FSJMODEL"
FORMAT_VERSION = 1


def dump(model) -> bytes:
    arrays: dict[str, np.ndarray] = {}

    def put(part: str, d: dict[str, np.ndarray]) -> None:
        for k, v in d.items():
            arrays[f"{part}/{k}"] = v

    gmm_meta, gmm_arrays = model.gmm.state()
    put("gmm", gmm_arrays)
    put("scaler", model.scaler.state())
    put("peers", model.peers.state())
    thr_meta = {}
    for name, t in model.thresholds.items():
        thr_meta[name], a = t.state()
        put(f"thr_{name}", a)
    meta = {
        "format": FORMAT_VERSION,
        "config": asdict(model.config),
        "index": model.index.state(),
        "windows": model.windows, "last_window_ns": model.last_window_ns,
        "flagged_run": model.flagged_run, "stats": model.stats,
        "gmm": gmm_meta, "thresholds": thr_meta,
    }
    meta["admission"], a = model.admission.state()
    put("admission", a)
    if model.mahal:
        meta["mahal"], a = model.mahal.g.state()
        put("mahal", a)
    if model.hst:
        put("hst", model.hst.state())
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    buf = io.BytesIO()
    buf.write(MAGIC)
    np.savez(buf, **arrays)
    return buf.getvalue()


def load(blob: bytes):
    from fleetscope.streams.model.job_model import JobModel

    if not blob.startswith(MAGIC):
        raise ValueError("not a fleetscope job-model checkpoint (bad magic)")
    with np.load(io.BytesIO(blob[len(MAGIC):]), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays.pop("meta").tobytes())
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"checkpoint format {meta.get('format')} is not supported (this code reads {FORMAT_VERSION})")

    def part(name: str) -> dict[str, np.ndarray]:
        p = name + "/"
        return {k[len(p):]: v for k, v in arrays.items() if k.startswith(p)}

    cfg = meta["config"]
    cfg["detectors"] = tuple(cfg["detectors"])
    model = JobModel(ModelConfig(**cfg))
    model.index = FeatureIndex.from_state(meta["index"])
    model.windows, model.last_window_ns = meta["windows"], meta["last_window_ns"]
    model.flagged_run, model.stats = meta["flagged_run"], meta["stats"]
    model.gmm.load(meta["gmm"], part("gmm"))
    model.scaler.load(part("scaler"))
    model.peers.load(part("peers"))
    for name, t in model.thresholds.items():
        t.load(meta["thresholds"][name], part(f"thr_{name}"))
    if "admission" in meta:
        model.admission.load(meta["admission"], part("admission"))
    elif model.windows > model.config.warmup_windows // 2:   # written before admission existed
        model.admission.fix(model.scaler.ready())
    if model.mahal:
        model.mahal.g.load(meta["mahal"], part("mahal"))
    if model.hst:
        model.hst.load(part("hst"))
    return model
