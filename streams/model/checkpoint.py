"""Versioned, compact checkpoint of a JobModel: plain arrays + JSON, nothing unpickled.

The container (state_archive.py) is MAGIC then an uncompressed .npz; entry
"meta" holds the JSON (format version, config, and the model's own state:
feature names, counters, scalars such as the random generators' states); every
other entry is one array, named "<part>/<name>". The model saves and restores
itself (JobModel.state/load, each detector through the detector protocol);
this module owns the container, the version and the config. Every part checks
its arrays' dtypes and shapes against the model it is loaded into; any fault
raises CheckpointError, and the caller relearns the job from scratch.

Restoring gives bit-identical state (arrays are stored as they are, floats
in JSON round-trip exactly), so later scores equal an uninterrupted run.

Parts: the job's detectors that live outside the model (the job-rate and OFU
history of model/job_rate.py, the memory-drift series of model/drift.py) are
saved beside it under meta["parts"][name] and arrays "part_<name>/...". Each
part has ``state() -> (meta, arrays)`` and ``load(meta, arrays)``; a loader
that is not given a saved part skips it (StateArrays.discard).
"""
from __future__ import annotations

from dataclasses import asdict, fields

from fleetscope.streams.model import state_archive
from fleetscope.streams.model.config import ModelConfig
from fleetscope.streams.model.state_archive import MAGIC, CheckpointError

__all__ = ["MAGIC", "CheckpointError", "JobPart", "dump", "load"]
FORMAT_VERSION = 4   # 2: HalfSpaceTrees as arrays (1 held river's trees as a pickle: never read again);
#                      3: every detector's state under "det_<name>/", the model's own under "model";
#                      4: the job's other detectors as parts (3 is still read: it has none, they relearn)
READABLE = (3, 4)


class JobPart:
    """One job's share of a detector that keeps many jobs, as a part: the owner has
    ``state(job) -> (meta, arrays)`` and ``load(job, meta, arrays)``."""

    def __init__(self, owner, job: tuple[str, str]):
        self.owner, self.job = owner, job

    def state(self):
        return self.owner.state(self.job)

    def load(self, meta, arrays) -> None:
        self.owner.load(self.job, meta, arrays)


def dump(model, parts=None) -> bytes:
    meta, arrays = model.state()
    saved = {}
    for name, part in (parts or {}).items():
        saved[name], a = part.state()
        arrays.update({f"part_{name}/{k}": v for k, v in a.items()})
    return state_archive.write({"format": FORMAT_VERSION, "config": asdict(model.config), "model": meta,
                                "parts": saved}, arrays)


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


def load(blob: bytes, model_class, parts=None):
    """The model saved in ``blob``, built with ``model_class(config)``, and each of ``parts`` restored
    from its saved state where the checkpoint has it (else it relearns); raises CheckpointError."""
    meta, arrays = state_archive.read(blob)
    if meta.get("format") not in READABLE:
        raise CheckpointError(f"checkpoint format {meta.get('format')!r} is not supported "
                              f"(this code reads {READABLE}); the job's model relearns")
    model = model_class(config_from(meta.get("config")))
    model.load(arrays.mapping(meta, "model"), arrays)
    saved = arrays.mapping(meta, "parts") if meta["format"] >= 4 else {}
    parts = parts or {}
    for name in saved:
        if not isinstance(name, str) or not name.isidentifier():
            arrays.fail(f"parts: {name!r} is not a part name")
        if name in parts:
            parts[name].load(saved[name], arrays.part(f"part_{name}"))
        else:
            arrays.part(f"part_{name}").discard()
    arrays.check_all_taken()
    return model
