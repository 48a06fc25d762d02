"""The job model's checkpoint container: MAGIC, then an uncompressed .npz of plain arrays.

Entry "meta" holds the JSON (format version, config, counters, scalars); every
other entry is one array named "<part>/<name>". Only float64, int64, bool and
uint8 arrays are written or read. Nothing in a checkpoint is ever unpickled:
a checkpoint comes from a topic and a table that others can write to.

Reading never trusts a size it has not checked: the blob, the number of
entries, each entry's stored size, and each array's declared dtype and shape
are checked against limits and against each other before anything is
allocated (``np.load`` would allocate what a crafted header declares). The
model's parts then ask for their arrays by name with the dtype and shape
they expect (``StateArrays.take``). Any fault is one ``CheckpointError``.
"""
from __future__ import annotations

import ast
import io
import json
import zipfile
from typing import Any

import numpy as np

MAGIC = b"FSJMODEL"
MAX_BLOB_BYTES = 64 << 20      # full covariance at 256 features and 8 components is ~4 MiB
MAX_ENTRIES = 256
MAX_NDIM = 3
MAX_HEADER_BYTES = 4096
DTYPES = {"<f8": np.float64, "<i8": np.int64, "|b1": np.bool_, "|u1": np.uint8}
KINDS = {"f8": "<f8", "i8": "<i8", "b1": "|b1", "u1": "|u1"}


class CheckpointError(ValueError):
    """A model checkpoint cannot be used; the message says what is wrong with it, in one line."""


def write(meta: dict, arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    buf.write(MAGIC)
    out = {}
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        if a.dtype.str not in DTYPES:
            raise TypeError(f"checkpoint array {name} has dtype {a.dtype}; only {sorted(DTYPES)} are stored")
        out[name] = a
    out["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(buf, **out)
    return buf.getvalue()


def read(blob: bytes) -> tuple[dict, "StateArrays"]:
    if len(blob) > MAX_BLOB_BYTES:
        raise CheckpointError(f"checkpoint is {len(blob)} bytes, over the {MAX_BLOB_BYTES}-byte limit")
    if not blob.startswith(MAGIC):
        raise CheckpointError("not a fleetscope job-model checkpoint (bad magic)")
    try:
        archive = zipfile.ZipFile(io.BytesIO(blob[len(MAGIC):]))
        infos = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError,
            NotImplementedError, RuntimeError) as exc:   # unsupported or encrypted zip features
        raise CheckpointError(f"checkpoint archive is unreadable: {exc}") from None
    if len(infos) > MAX_ENTRIES:
        raise CheckpointError(f"checkpoint has {len(infos)} entries, over the limit of {MAX_ENTRIES}")
    arrays: dict[str, np.ndarray] = {}
    for info in infos:
        name = info.filename[:-4] if info.filename.endswith(".npy") else None
        if name is None or name in arrays:
            raise CheckpointError(f"checkpoint entry {info.filename!r} is not one .npy array")
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size \
                or info.file_size > len(blob):
            raise CheckpointError(f"checkpoint entry {name}: stored size {info.file_size} does not fit the "
                                  f"{len(blob)}-byte blob (only uncompressed entries are read)")
        try:
            data = archive.read(info)
        except (zipfile.BadZipFile, ValueError, OSError, EOFError, NotImplementedError, RuntimeError) as exc:
            raise CheckpointError(f"checkpoint entry {name} is unreadable: {exc}") from None
        arrays[name] = _npy(name, data)
    raw = arrays.pop("meta", None)
    if raw is None or raw.dtype != np.uint8 or raw.ndim != 1:
        raise CheckpointError("checkpoint has no meta entry (uint8 JSON)")
    try:
        meta = json.loads(raw.tobytes())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:   # RecursionError: nested too deep
        raise CheckpointError(f"checkpoint meta is not JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise CheckpointError("checkpoint meta is not a JSON object")
    return meta, StateArrays(arrays)


def _npy(name: str, data: bytes) -> np.ndarray:
    """One .npy file, its header parsed and checked before its data is looked at."""
    if len(data) < 10 or data[:6] != b"\x93NUMPY" or data[6] not in (1, 2, 3):
        raise CheckpointError(f"checkpoint entry {name} is not a .npy array (bad magic or version)")
    size_bytes = 2 if data[6] == 1 else 4
    hlen = int.from_bytes(data[8:8 + size_bytes], "little")
    start = 8 + size_bytes
    if hlen > MAX_HEADER_BYTES or start + hlen > len(data):
        raise CheckpointError(f"checkpoint entry {name}: header of {hlen} bytes is truncated or over the limit")
    try:
        header = ast.literal_eval(data[start:start + hlen].decode("latin1"))   # literals only, never code
    except (ValueError, SyntaxError, MemoryError, RecursionError) as exc:
        raise CheckpointError(f"checkpoint entry {name}: unreadable .npy header ({exc})") from None
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise CheckpointError(f"checkpoint entry {name}: .npy header must have descr, fortran_order and shape")
    descr, shape = header["descr"], header["shape"]
    if descr not in DTYPES:
        raise CheckpointError(f"checkpoint entry {name}: dtype {descr!r} is not one of {sorted(DTYPES)}")
    if header["fortran_order"] is not False:
        raise CheckpointError(f"checkpoint entry {name}: only C-order arrays are read")
    if not isinstance(shape, tuple) or len(shape) > MAX_NDIM \
            or not all(type(n) is int and 0 <= n <= MAX_BLOB_BYTES for n in shape):
        raise CheckpointError(f"checkpoint entry {name}: shape {shape!r} is not up to {MAX_NDIM} sizes "
                              f"in [0, {MAX_BLOB_BYTES}]")
    dtype = np.dtype(DTYPES[descr])
    count = 1
    for n in shape:
        count *= n
    body = len(data) - start - hlen
    if count * dtype.itemsize != body:
        raise CheckpointError(f"checkpoint entry {name}: shape {shape} of {descr} needs "
                              f"{count * dtype.itemsize} bytes, the entry holds {body}")
    return np.frombuffer(data, dtype=dtype, count=count, offset=start + hlen).reshape(shape).copy()


class StateArrays:
    """The arrays of one part of a checkpoint; each is taken with the dtype and shape its owner expects."""

    def __init__(self, arrays: dict[str, np.ndarray], prefix: str = "", taken: set[str] | None = None):
        self._arrays = arrays
        self.prefix = prefix
        self._taken = set() if taken is None else taken   # shared by the parts: what nobody took is refused

    def part(self, name: str) -> "StateArrays":
        return StateArrays(self._arrays, f"{self.prefix}{name}/", self._taken)

    def discard(self) -> None:
        """Mark every array of this part read: a part the loader was not asked to restore (a tool that
        reads only the model) is skipped on purpose, not refused as unknown."""
        self._taken.update(k for k in self._arrays if k.startswith(self.prefix))

    def check_all_taken(self) -> None:
        """Every array was read by some part: an entry this code does not know is an error, not ignored."""
        extra = sorted(set(self._arrays) - self._taken)
        if extra:
            raise CheckpointError(f"checkpoint has entries this model does not have: {extra[:5]}")

    def fail(self, what: str) -> None:
        raise CheckpointError(f"checkpoint {self.prefix}{what}")

    def take(self, name: str, kind: str, shape: tuple[int | None, ...]) -> np.ndarray:
        """The array ``name``: dtype ``kind`` (f8, i8, b1, u1), shape ``shape`` (None: any size there)."""
        a = self._arrays.get(self.prefix + name)
        if a is None:
            self.fail(f"{name}: missing array")
        if a.dtype.str != KINDS[kind]:
            self.fail(f"{name}: dtype {a.dtype.str}, expected {KINDS[kind]}")
        if a.ndim != len(shape) or any(want is not None and got != want for got, want in zip(a.shape, shape)):
            want = tuple("*" if s is None else s for s in shape)
            self.fail(f"{name}: shape {a.shape}, expected {want}")
        self._taken.add(self.prefix + name)
        return a

    # scalars of the meta JSON, checked the same way
    def count(self, meta: Any, key: str, most: int) -> int:
        v = meta.get(key) if isinstance(meta, dict) else None
        if type(v) is not int or not 0 <= v <= most:
            self.fail(f"{key}: {v!r} is not an integer in [0, {most}]")
        return v

    def number(self, meta: Any, key: str, allow_none: bool = False) -> float | None:
        v = meta.get(key) if isinstance(meta, dict) else None
        if v is None and allow_none:
            return None
        if type(v) not in (int, float):
            self.fail(f"{key}: {v!r} is not a number")
        return v

    def flag(self, meta: Any, key: str) -> bool:
        v = meta.get(key) if isinstance(meta, dict) else None
        if type(v) is not bool:
            self.fail(f"{key}: {v!r} is not true or false")
        return v

    def mapping(self, meta: Any, key: str) -> dict:
        v = meta.get(key) if isinstance(meta, dict) else None
        if not isinstance(v, dict):
            self.fail(f"{key}: missing or not an object")
        return v
