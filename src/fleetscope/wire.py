"""The wire format: one Kafka message holds one columnar batch of events.

A batch is all from one source on one node. Layout (little-endian):

    magic  b"FSCB"                4 bytes
    schema_version                u16
    n_columns                     u16
    n_rows                        u32
    meta_len                      u32
    meta                          JSON object: source, host, batch_id, created_ns, extras
    n_columns x column:
        name_len u8, name (utf-8), type_code u8, payload_len u32, payload
    crc32 of everything above     u32

Numeric columns are raw little-endian arrays. String columns are
dictionary-encoded (`StrColumn`): a JSON list of distinct values, then one
u32 code per row. Nothing here loops per event, so encode and decode run at
memory speed; see benchmarks/codec_bench.py.

Samplers hand encode the same column objects tick after tick (producers/
host/columns.py: metric names, devices, the node identity), made read-only.
encode keeps the bytes of such a column, one whose array is read-only and
owns its memory, and reuses them while the same object comes back read-only.
"""
from __future__ import annotations

import functools
import json
import json.encoder
import struct
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

MAGIC = b"FSCB"
SCHEMA_VERSION = 1
_PREFIX = struct.Struct("<4sHHII")
_COL_HEAD = struct.Struct("<B")
_COL_TYPE = struct.Struct("<BI")
_SIZE = struct.Struct("<I")
_CRC = struct.Struct("<I")

# Kafka header names; the same facts are inside the payload, and decode
# checks that the two agree.
H_SCHEMA, H_SOURCE, H_HOST, H_BATCH, H_COUNT = (
    "fs-schema", "fs-source", "fs-host", "fs-batch", "fs-count")

_NUMERIC_CODES = {
    1: np.dtype("<i1"), 2: np.dtype("<i2"), 3: np.dtype("<i4"), 4: np.dtype("<i8"),
    5: np.dtype("<u1"), 6: np.dtype("<u2"), 7: np.dtype("<u4"), 8: np.dtype("<u8"),
    9: np.dtype("<f4"), 10: np.dtype("<f8"),
}
_CODE_OF_DTYPE = {dt: code for code, dt in _NUMERIC_CODES.items()}
_STR_CODE = 20


class WireError(ValueError):
    """A message that is not a valid batch. The message says exactly why."""


@dataclass(frozen=True)
class StrColumn:
    """A dictionary-encoded string column: `values[codes[i]]` is row i."""

    codes: np.ndarray  # uint32
    values: tuple[str, ...]

    @classmethod
    def of(cls, items) -> "StrColumn":
        """Encode a sequence of strings (convenience; producers that know
        their dictionary should build codes directly)."""
        values, codes = np.unique(np.asarray(items, dtype=object).astype(str), return_inverse=True)
        return cls(codes.astype(np.uint32), tuple(str(v) for v in values))

    @classmethod
    def constant(cls, value: str, n: int) -> "StrColumn":
        return cls(np.zeros(n, dtype=np.uint32), (value,))

    def __len__(self) -> int:
        return len(self.codes)

    def to_numpy(self) -> np.ndarray:
        """Decoded as a numpy array of Python strings (for stores, tests)."""
        return np.asarray(self.values, dtype=object)[self.codes] if len(self.values) else np.empty(0, dtype=object)


Column = np.ndarray | StrColumn


@dataclass
class Batch:
    source: str
    host: str
    columns: dict[str, Column]
    batch_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created_ns: int = 0
    extras: dict = field(default_factory=dict)  # e.g. sampling_fraction

    def __post_init__(self) -> None:
        lengths = {name: len(col) for name, col in self.columns.items()}
        if len(set(lengths.values())) > 1:
            raise WireError(f"columns differ in length: {lengths}")

    @property
    def count(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def kafka_headers(self) -> list[tuple[str, bytes]]:
        return [(H_SCHEMA, str(SCHEMA_VERSION).encode()), (H_SOURCE, self.source.encode()),
                (H_HOST, self.host.encode()), (H_BATCH, self.batch_id.encode()),
                (H_COUNT, str(self.count).encode())]


@functools.lru_cache(maxsize=1024)
def _vocabulary(values: tuple[str, ...]) -> bytes:
    """A string column's dictionary as JSON. Samplers reuse one dictionary tick after tick
    (the same metric and device names), so it is serialized once: json.dumps cost ~20 µs per
    column a batch, a hash lookup of the tuple under 1 µs."""
    return json.dumps(list(values), separators=(",", ":")).encode()


_json_str = json.encoder.encode_basestring_ascii  # a str as json.dumps writes it


def _meta(batch: Batch) -> bytes:
    """json.dumps of the metadata object, compact, written out directly: the same
    bytes, without the encoder's setup on every batch."""
    extras = json.dumps(batch.extras, separators=(",", ":")) if batch.extras else "{}"
    return (f'{{"source":{_json_str(batch.source)},"host":{_json_str(batch.host)},'
            f'"batch_id":{_json_str(batch.batch_id)},"created_ns":{int(batch.created_ns)},'
            f'"extras":{extras}}}').encode()


# (name, id(column)) -> (column, its encoded bytes), for immutable columns (see the
# module docstring). Holding the column keeps its id from being reused.
_FROZEN: dict[tuple[str, int], tuple[Column, bytes]] = {}
_FROZEN_MAX = 128
_FROZEN_BYTES = 1 << 16  # larger columns are encoded every time (bounds the cache's memory)


def _immutable(col: Column) -> bool:
    arr = col.codes if isinstance(col, StrColumn) else col
    return isinstance(arr, np.ndarray) and not arr.flags.writeable and arr.base is None


def encode(batch: Batch) -> bytes:
    """Serialize a batch. Raises WireError for columns it cannot carry."""
    if not batch.columns:
        raise WireError("a batch needs at least one column")
    if batch.count == 0:
        raise WireError("a batch needs at least one event; empty batches are not sent")
    meta = _meta(batch)
    parts = [_PREFIX.pack(MAGIC, SCHEMA_VERSION, len(batch.columns), batch.count, len(meta)), meta]
    for name, col in batch.columns.items():
        key = (name, id(col))
        kept = _FROZEN.get(key)
        if kept is not None and kept[0] is col and _immutable(col):
            parts.append(kept[1])
            continue
        part = _encode_column(name, col)
        if len(part) <= _FROZEN_BYTES and _immutable(col):
            _remember(_FROZEN, key, (col, part), _FROZEN_MAX)
        parts.append(part)
    body = b"".join(parts)
    return body + _CRC.pack(zlib.crc32(body))


def _encode_column(name: str, col: Column) -> bytes:
    raw_name = name.encode()
    if not 0 < len(raw_name) < 256:
        raise WireError(f"column name {name!r} must be 1..255 bytes")
    if isinstance(col, StrColumn):
        vocab = _vocabulary(tuple(col.values))
        codes = np.ascontiguousarray(col.codes, dtype="<u4")
        payload = [_SIZE.pack(len(vocab)), vocab, codes.tobytes()]
        code, size = _STR_CODE, 4 + len(vocab) + codes.nbytes
    elif type(col) is np.ndarray and col.ndim == 1 and col.flags.c_contiguous and col.dtype in _CODE_OF_DTYPE:
        data = col.tobytes()  # the usual numeric column: already little-endian, 1-d and contiguous
        payload, code, size = [data], _CODE_OF_DTYPE[col.dtype], len(data)
    else:
        arr = np.asarray(col)
        dt = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
        if dt not in _CODE_OF_DTYPE or arr.ndim != 1:
            raise WireError(f"column {name!r}: unsupported array {arr.dtype}/{arr.ndim}-d")
        data = np.ascontiguousarray(arr, dtype=dt).tobytes()
        payload, code, size = [data], _CODE_OF_DTYPE[dt], len(data)
    return b"".join([_COL_HEAD.pack(len(raw_name)), raw_name, _COL_TYPE.pack(code, size), *payload])


def decode(value: bytes | memoryview | None, headers: Mapping[str, bytes] | list | None = None) -> Batch:
    """Parse and validate a batch; raise WireError saying precisely what is wrong."""
    if value is None:
        raise WireError("empty message (no value)")
    buf = memoryview(value)
    if len(buf) < _PREFIX.size + _CRC.size:
        raise WireError(f"message of {len(buf)} bytes is shorter than the {_PREFIX.size + _CRC.size}-byte minimum")
    magic, version, n_cols, n_rows, meta_len = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}: not a fleetscope batch")
    if version > SCHEMA_VERSION:
        raise WireError(f"schema version {version} is newer than this worker supports ({SCHEMA_VERSION}); upgrade fleetscope")
    if version < 1:
        raise WireError(f"schema version {version} is invalid")
    (crc,) = _CRC.unpack_from(buf, len(buf) - _CRC.size)
    if zlib.crc32(buf[:-_CRC.size]) != crc:
        raise WireError("checksum mismatch: the batch is truncated or corrupted")
    pos = _PREFIX.size
    end = len(buf) - _CRC.size
    meta = _parse_meta(buf, pos, meta_len, end)
    pos += meta_len
    columns: dict[str, Column] = {}
    for index in range(n_cols):
        name, col, pos = _parse_column(buf, pos, end, n_rows, index)
        if name in columns:
            raise WireError(f"column {name!r} appears twice")
        columns[name] = col
    if pos != end:
        raise WireError(f"{end - pos} trailing bytes after the last column")
    batch = Batch(source=meta["source"], host=meta["host"], columns=columns, batch_id=meta["batch_id"],
                  created_ns=int(meta.get("created_ns", 0)), extras=meta.get("extras") or {})
    if headers is not None:
        _check_headers(batch, version, headers)
    return batch


def _need(pos: int, size: int, end: int, what: str) -> None:
    if pos + size > end:
        raise WireError(f"truncated: {what} needs {size} bytes at offset {pos}, only {max(end - pos, 0)} left")


def _parse_meta(buf: memoryview, pos: int, meta_len: int, end: int) -> dict:
    _need(pos, meta_len, end, "metadata")
    try:
        meta = json.loads(bytes(buf[pos:pos + meta_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"metadata is not valid JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise WireError("metadata is not a JSON object")
    for key in ("source", "host", "batch_id"):
        if not isinstance(meta.get(key), str) or not meta[key]:
            raise WireError(f"metadata lacks a non-empty string {key!r}")
    return meta


_HEADS: dict[bytes, tuple[str, int]] = {}  # a column's name bytes + type code -> (name, type code)
_VOCABS: dict[bytes, tuple[str, ...]] = {}  # a string column's dictionary JSON -> its values
_CACHE_MAX = 4096  # entries per cache; producers repeat the same few columns and dictionaries
_VOCAB_CACHED_BYTES = 4096  # larger dictionaries are parsed every time (bounds the cache's memory)


def _remember(cache: dict, key, value, limit: int = _CACHE_MAX):
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value
    return value


def _parse_column(buf: memoryview, pos: int, end: int, n_rows: int, index: int):
    _need(pos, 1, end, f"column {index} name length")
    name_len = buf[pos]
    pos += 1
    head = bytes(buf[pos:pos + name_len + 1])  # the name and the type code
    known = _HEADS.get(head)
    if known is None or pos + name_len + _COL_TYPE.size > end:
        _need(pos, name_len, end, f"column {index} name")
        try:
            name = head[:name_len].decode()
        except UnicodeDecodeError:
            raise WireError(f"column {index} name is not UTF-8") from None
        _need(pos + name_len, _COL_TYPE.size, end, f"column {name!r} type")
        known = _remember(_HEADS, head, (name, head[name_len]))
    name, code = known
    pos += name_len
    (size,) = _SIZE.unpack_from(buf, pos + 1)
    pos += _COL_TYPE.size
    if pos + size > end:
        _need(pos, size, end, f"column {name!r} data")
    dt = _NUMERIC_CODES.get(code)
    if dt is not None:
        if size != n_rows * dt.itemsize:
            raise WireError(f"column {name!r}: {size} bytes is not {n_rows} rows of {dt}")
        col: Column = np.frombuffer(buf, dtype=dt, count=n_rows, offset=pos)
    elif code == _STR_CODE:
        col = _parse_str_column(name, buf[pos:pos + size], n_rows)
    else:
        raise WireError(f"column {name!r}: unknown type code {code}")
    return name, col, pos + size


def _parse_str_column(name: str, data: memoryview, n_rows: int) -> StrColumn:
    if len(data) < 4:
        raise WireError(f"string column {name!r} lacks its dictionary length")
    (vocab_len,) = _SIZE.unpack_from(data, 0)
    if 4 + vocab_len + 4 * n_rows != len(data):
        raise WireError(f"string column {name!r}: sizes do not add up ({len(data)} bytes for {n_rows} rows)")
    raw = bytes(data[4:4 + vocab_len])
    values = _VOCABS.get(raw)
    if values is None:
        try:
            parsed = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise WireError(f"string column {name!r}: dictionary is not valid JSON: {exc}") from None
        if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
            raise WireError(f"string column {name!r}: dictionary is not a list of strings")
        values = tuple(parsed)
        if vocab_len <= _VOCAB_CACHED_BYTES:
            _remember(_VOCABS, raw, values)
    codes = np.frombuffer(data, dtype="<u4", offset=4 + vocab_len)
    if n_rows and int(codes.max()) >= len(values):
        raise WireError(f"string column {name!r}: code {int(codes.max())} outside a dictionary of {len(values)}")
    return StrColumn(codes, values)


def _check_headers(batch: Batch, version: int, headers) -> None:
    h = dict(headers) if not isinstance(headers, Mapping) else headers
    expected = {H_SCHEMA: str(version), H_SOURCE: batch.source, H_HOST: batch.host,
                H_BATCH: batch.batch_id, H_COUNT: str(batch.count)}
    for key, want in expected.items():
        got = h.get(key)
        if got is None:
            continue  # headers are an optimisation for routers; the payload is authoritative
        got = got.decode(errors="replace") if isinstance(got, (bytes, bytearray)) else str(got)
        if got != want:
            raise WireError(f"header {key}={got!r} disagrees with the payload ({want!r})")
