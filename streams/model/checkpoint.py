"""Versioned, compact checkpoint of a JobModel: plain arrays + JSON, nothing unpickled.

The container (state_archive.py) is MAGIC then an uncompressed .npz; entry
"meta" holds the JSON (format version, config, feature names, counters,
scalars such as the random generators' states); every other entry is one
array, named "<part>/<name>". Every part checks its arrays' dtypes and shapes
against the model it is loaded into; any fault raises CheckpointError, and
the caller relearns the job from scratch.

Restoring gives bit-identical state (arrays are stored as they are, floats
in JSON round-trip exactly), so later scores equal an uninterrupted run.
"""
from __future__ import annotations

from dataclasses import asdict, fields

from fleetscope.streams.model import state_archive
from fleetscope.streams.model.config import ModelConfig
from fleetscope.streams.model.feature_index import FeatureIndex
from fleetscope.streams.model.state_archive import MAGIC, CheckpointError, StateArrays

__all__ = ["MAGIC", "CheckpointError", "dump", "load"]
FORMAT_VERSION = 2   # 2: HalfSpaceTrees as arrays (1 held river's trees as a pickle: never read again)


def dump(model) -> bytes:
    arrays = {}

    def put(part: str, d: dict) -> None:
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
        meta["hst"], a = model.hst.state()
        put("hst", a)
    return state_archive.write(meta, arrays)


def config_from(doc) -> ModelConfig:
    """The saved ModelConfig, each field of the type its default has (a checkpoint is untrusted input)."""
    if not isinstance(doc, dict):
        raise CheckpointError("checkpoint config: not an object")
    known = {f.name: f for f in fields(ModelConfig)}
    unknown = sorted(set(doc) - set(known))
    if unknown:
        raise CheckpointError(f"checkpoint config: unknown fields {unknown}")
    values = {}
    for name, value in doc.items():
        default = known[name].default
        if name == "detectors":
            ok = isinstance(value, list) and all(isinstance(d, str) for d in value)
            value = tuple(value) if ok else value
        elif default is None or name == "k":
            ok = value is None or type(value) is int
        elif type(default) is float:
            ok = type(value) in (int, float)
        else:
            ok = type(value) is type(default)
        if not ok:
            raise CheckpointError(f"checkpoint config: {name}={value!r} has the wrong type")
        values[name] = value
    try:
        return ModelConfig(**values)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint config: {exc}") from None


def load(blob: bytes, model_class):
    """The model saved in ``blob``, built with ``model_class(config)``; raises CheckpointError."""
    meta, arrays = state_archive.read(blob)
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint format {meta.get('format')!r} is not supported "
                              f"(this code reads {FORMAT_VERSION}); the job's model relearns")
    model = model_class(config_from(meta.get("config")))
    try:
        model.index = FeatureIndex.from_state(meta.get("index"), model.config.max_features)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {exc}") from None
    dim = model.index.size
    for key in ("windows", "flagged_run"):
        setattr(model, key, arrays.count(meta, key, 1 << 62))
    last = meta.get("last_window_ns")
    if type(last) is not int or not -1 <= last < 1 << 63:
        raise CheckpointError(f"checkpoint last_window_ns: {last!r} is not a time in ns")
    model.last_window_ns = last
    stats = meta.get("stats")
    if not isinstance(stats, dict) or set(stats) - set(model.stats) \
            or not all(type(v) is int and v >= 0 for v in stats.values()):
        raise CheckpointError("checkpoint stats: not an object of this model's counters")
    model.stats.update(stats)
    model.gmm.load(arrays.mapping(meta, "gmm"), arrays.part("gmm"), dim)
    model.scaler.load(arrays.part("scaler"), dim)
    model.peers.load(arrays.part("peers"), dim)
    thresholds = arrays.mapping(meta, "thresholds")
    if set(thresholds) != set(model.thresholds):
        raise CheckpointError(f"checkpoint thresholds: {sorted(thresholds)}, expected {sorted(model.thresholds)}")
    for name, t in model.thresholds.items():
        t.load(thresholds[name], arrays.part(f"thr_{name}"))
    model.admission.load(arrays.mapping(meta, "admission"), arrays.part("admission"), dim)
    if model.mahal:
        model.mahal.g.load(arrays.mapping(meta, "mahal"), arrays.part("mahal"), dim)
    if model.hst:
        model.hst.load(arrays.mapping(meta, "hst"), arrays.part("hst"), dim)
    arrays.check_all_taken()
    return model
