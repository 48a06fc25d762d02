"""A batch as one Arrow IPC stream: the schema, one dictionary batch per string
column, one record batch, end of stream; buffers zstd-compressed.

Anything that reads Arrow reads a raw message as it is: pyarrow, DuckDB,
Spark, and ClickHouse with `FORMAT ArrowStream` or its Kafka engine with
`kafka_format='ArrowStream'`. String columns travel as Arrow dictionaries
(uint32 indices), built from a StrColumn's codes and values without
re-encoding, and read back as StrColumns; ClickHouse sees LowCardinality(String).

Arrow checks the structure (a truncated stream fails), but not the content:
measured on 3,000 single-bit flips of a zstd stream, 94% decoded into other
values without any error. So the schema metadata carries a CRC-32 of every
byte of the message except the checksum's own 8 hex digits (see `seal`), and
decode checks it, on the bytes as received, before it trusts anything else.
"""
from __future__ import annotations

import functools
import zlib

import numpy as np
import pyarrow as pa

from fleetscope import ipc_frames
from fleetscope import wire_metadata as md
from fleetscope.batch import SCHEMA_VERSION, Batch, Column, StrColumn, WireError

CONTINUATION = ipc_frames.CONTINUATION  # every encapsulated Arrow IPC message starts with it
MAX_MESSAGE_BYTES = 64 << 20
# What one message may hold once decompressed: 4x the message limit, ~5M events of 50 bytes.
# Beyond it, and beyond 8 bytes a row per record batch buffer, a message is refused as a
# decompression bomb before anything is decompressed (ipc_frames.read_body).
MAX_DECODED_BYTES = 256 << 20
CRC_PLACEHOLDER = b"00000000"  # the checksum's place while the checksum is computed
# One thread: a worker is one process per core, and on a busy machine the thread pool's
# hand-offs cost more than parallel zstd saves (measured 350 vs 200 us per 1k-event batch).
_READ_OPTIONS = pa.ipc.IpcReadOptions(use_threads=False)
_WRITE_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd")
_STRING = pa.string()
_INDEX_TYPE = pa.uint32()
_STR_TYPE = pa.dictionary(pa.uint32(), _STRING)
_ARROW_OF_DTYPE = {
    np.dtype("<i1"): pa.int8(), np.dtype("<i2"): pa.int16(), np.dtype("<i4"): pa.int32(), np.dtype("<i8"): pa.int64(),
    np.dtype("<u1"): pa.uint8(), np.dtype("<u2"): pa.uint16(), np.dtype("<u4"): pa.uint32(), np.dtype("<u8"): pa.uint64(),
    np.dtype("<f4"): pa.float32(), np.dtype("<f8"): pa.float64(),
}
_NUMERIC_TYPE_IDS = frozenset(t.id for t in _ARROW_OF_DTYPE.values())
_DICTIONARY_TYPE_ID = _STR_TYPE.id
_INDEX_TYPE_ID = _INDEX_TYPE.id
_DICT_CACHED = 256  # dictionaries up to this many values are built once (samplers repeat theirs every tick)


# ---- encode -----------------------------------------------------------------------------

@functools.lru_cache(maxsize=1024)
def _cached_dictionary(values: tuple[str, ...]) -> pa.Array:
    return pa.array(values, type=pa.string())


def _arrow_column(name: str, col: Column) -> tuple[pa.Field, pa.Array]:
    if not isinstance(name, str) or not 0 < len(name.encode(errors="replace")) < 256:
        raise WireError(f"column name {name!r} must be 1..255 bytes of text")
    if isinstance(col, StrColumn):
        try:
            values = tuple(col.values)
            dictionary = _cached_dictionary(values) if len(values) <= _DICT_CACHED else pa.array(values, type=pa.string())
        except (UnicodeEncodeError, pa.ArrowException, TypeError) as exc:
            raise WireError(f"string column {name!r} has a value Arrow cannot carry: {exc}") from None
        codes = np.ascontiguousarray(col.codes, dtype="<u4")
        if len(codes) and int(codes.max()) >= len(values):
            raise WireError(f"string column {name!r}: code {int(codes.max())} outside a dictionary of {len(values)}")
        return pa.field(name, _STR_TYPE, nullable=False), pa.DictionaryArray.from_arrays(pa.array(codes), dictionary)
    arr = col if type(col) is np.ndarray else np.asarray(col)
    dt = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
    arrow_type = _ARROW_OF_DTYPE.get(dt)
    if arrow_type is None or arr.ndim != 1:
        raise WireError(f"column {name!r}: unsupported array {arr.dtype}/{arr.ndim}-d")
    return pa.field(name, arrow_type, nullable=False), pa.array(np.ascontiguousarray(arr, dtype=dt), type=arrow_type)


def schema_end(view: memoryview) -> int:
    """Where the first message (the schema) ends; the stream is checked just enough to say so."""
    if len(view) < 8:
        raise WireError(f"truncated: {len(view)} bytes cannot hold an Arrow IPC message prefix")
    if bytes(view[:4]) != CONTINUATION:
        raise WireError(f"bad magic {bytes(view[:4])!r}: not an Arrow IPC stream, not a fleetscope batch")
    length = int.from_bytes(view[4:8], "little", signed=True)
    if length <= 0 or length % 8:
        raise WireError(f"bad schema message length {length}: not an Arrow IPC stream")
    if 8 + length > len(view):
        raise WireError(f"truncated: the schema message needs {length} bytes, only {len(view) - 8} left")
    return 8 + length


def seal(schema_message: bytes | memoryview, rest: bytes | memoryview, schema: pa.Schema | None = None) -> bytes:
    """The message: the schema message (from `schema`, else parsed from `schema_message`),
    with a checksum in its metadata over every byte of the message but the checksum's own
    8 hex digits, followed by `rest` (the dictionaries, record batch and end of stream).

    The decoder finds those 8 digits as the first flatbuffer string equal to them (see
    `_crc_string`); in the ~2^-32 case where another string in the schema equals the
    checksum, this raises WireError rather than send a message that would be refused."""
    if schema is None:
        schema = pa.ipc.read_schema(pa.py_buffer(schema_message))
    meta = {k: v for k, v in (schema.metadata or {}).items() if k != md.KEY_CRC}
    head = bytearray(schema.with_metadata({**meta, md.KEY_CRC: CRC_PLACEHOLDER}).serialize())
    placeholder = _crc_string(CRC_PLACEHOLDER)
    at = head.find(placeholder, 8) + 4
    if at < 4 or head.find(placeholder, at) >= 0:  # another "00000000" string: ask the flatbuffer
        at = ipc_frames.read_schema_message(memoryview(head)).value_at[md.KEY_CRC]
    crc = b"%08x" % zlib.crc32(rest, zlib.crc32(memoryview(head)[at + 8:], zlib.crc32(memoryview(head)[:at])))
    head[at:at + 8] = crc
    if head.find(_crc_string(crc), 8) != at - 4:
        raise WireError("batch cannot be sealed: a string in its schema equals its checksum; send it with another batch_id")
    return bytes(head) + bytes(rest)


def _crc_string(hex_digits: bytes) -> bytes:
    """The checksum as a flatbuffer string: its length, the 8 digits, the terminating NUL."""
    return b"\x08\x00\x00\x00" + hex_digits + b"\x00"


def encode(batch: Batch) -> bytes:
    """Serialize a batch. Raises WireError for a batch or column it cannot carry."""
    if not batch.columns:
        raise WireError("a batch needs at least one column")
    if batch.count == 0:
        raise WireError("a batch needs at least one event; empty batches are not sent")
    fields, arrays = zip(*(_arrow_column(name, col) for name, col in batch.columns.items()))
    schema = pa.schema(fields, metadata=md.to_arrow(batch, SCHEMA_VERSION))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema, options=_WRITE_OPTIONS) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays(list(arrays), schema=schema))
    view = memoryview(sink.getvalue())
    end = schema_end(view)
    return seal(view[:end], view[end:], schema)


# ---- decode -----------------------------------------------------------------------------

def _arrow_fault(what: str, exc: BaseException) -> WireError:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return WireError(f"{what}: {first[:200]}")


_CACHED_DICTIONARY_BYTES = 4096  # dictionaries up to this size are checked once and remembered by their bytes


@functools.lru_cache(maxsize=4096)
def _checked_strings(offsets: bytes, data: bytes, name: str, identity: bool) -> tuple[str, ...]:
    """A dictionary's strings from its raw buffers, with what Arrow's full validation checks
    (offsets in order and inside the data, valid UTF-8) and, for an identity column, the
    identity rules. Remembered by its bytes: producers resend the same few dictionaries.
    A bad one raises (WireError, or UnicodeDecodeError) and is not remembered."""
    bounds = np.frombuffer(offsets, dtype="<i4")
    if int(bounds[0]) < 0 or int(bounds[-1]) > len(data) or bool((bounds[1:] < bounds[:-1]).any()):
        raise WireError(f"corrupt Arrow stream: string column {name!r}: dictionary offsets "
                        "out of order or past its data")
    values = tuple(data[a:b].decode() for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()))
    if identity:
        for value in values:
            md.check_identity(f"column {name!r} value", value)
    return values


def _str_values(name: str, dictionary: pa.Array) -> tuple[str, ...]:
    if dictionary.null_count:
        raise WireError(f"string column {name!r}: its dictionary holds nulls")
    if dictionary.type != _STRING:
        raise WireError(f"string column {name!r}: dictionary of {dictionary.type}, expected string")
    start, n = dictionary.offset, len(dictionary)
    if n == 0:
        return ()
    identity = name in md.IDENTITY_COLUMNS
    _, offsets, data = dictionary.buffers()
    try:
        if data is None or data.size <= _CACHED_DICTIONARY_BYTES:
            raw_offsets = offsets.to_pybytes()[4 * start:4 * (start + n + 1)]
            if len(raw_offsets) != 4 * (n + 1):
                raise WireError(f"corrupt Arrow stream: string column {name!r}: dictionary offsets cut short")
            return _checked_strings(raw_offsets, data.to_pybytes() if data is not None else b"", name, identity)
        dictionary.validate(full=True)
        values = tuple(dictionary.to_pylist())
        if identity:
            for value in values:
                md.check_identity(f"column {name!r} value", value)
        return values
    except UnicodeDecodeError as exc:
        raise WireError(f"string column {name!r}: a value is not valid UTF-8 ({exc.reason})") from None
    except pa.ArrowException as exc:
        raise _arrow_fault(f"corrupt Arrow stream: string column {name!r}: corrupt dictionary", exc) from None


def _column(name: str, arr: pa.Array) -> Column:
    if arr.null_count:
        raise WireError(f"column {name!r} holds {arr.null_count} nulls; batches carry none")
    arrow_type = arr.type
    # by type id: a numeric type is its id, and comparing ints costs a tenth of hashing a DataType
    type_id = arrow_type.id
    if type_id in _NUMERIC_TYPE_IDS:
        return arr.to_numpy(zero_copy_only=True)
    if type_id != _DICTIONARY_TYPE_ID:
        raise WireError(f"column {name!r}: unsupported Arrow type {arrow_type}")
    if arrow_type.index_type.id != _INDEX_TYPE_ID:
        raise WireError(f"string column {name!r}: {arrow_type.index_type} indices, expected uint32")
    values = _str_values(name, arr.dictionary)
    codes = arr.indices.to_numpy(zero_copy_only=True)
    # what Arrow's full validation would check, at numpy speed: every code names a value
    if len(codes) and int(codes.max()) >= len(values):
        raise WireError(f"corrupt Arrow stream: string column {name!r} has code {int(codes.max())} "
                        f"outside its dictionary of {len(values)}")
    return StrColumn(codes, values)


def decode(value) -> Batch:
    """Parse and validate one message; raise WireError saying precisely what is wrong.

    Order: sizes; the schema's metadata; version; the checksum over the bytes as received;
    the message sequence and every buffer's declared uncompressed size (ipc_frames), all
    before Arrow decompresses anything; then Arrow's structural checks, and per column the
    value checks Arrow's full validation would make (codes inside the dictionary, offsets
    in order, UTF-8), done once per distinct dictionary."""
    if value is None:
        raise WireError("empty message (no value)")
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise WireError(f"message value is a {type(value).__name__}, not bytes")
    view = memoryview(value).cast("B") if isinstance(value, memoryview) else memoryview(value)
    if len(view) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(view)} bytes is over the {MAX_MESSAGE_BYTES}-byte limit")
    end = schema_end(view)
    try:
        meta = pa.ipc.read_schema(pa.py_buffer(view[:end])).metadata or {}
    except (pa.ArrowException, OSError) as exc:
        raise _arrow_fault("corrupt schema message", exc) from None
    version = md.version_of(meta)
    if version > SCHEMA_VERSION:
        raise WireError(f"schema version {version} is newer than this worker supports ({SCHEMA_VERSION}); upgrade fleetscope")
    if version < SCHEMA_VERSION:
        raise WireError(f"schema version {version} is older than the oldest this worker reads ({SCHEMA_VERSION})")
    _check_seal(view, end, meta)
    ipc_frames.read_body(view, end, MAX_DECODED_BYTES)
    try:
        record = pa.ipc.open_stream(pa.py_buffer(view), options=_READ_OPTIONS).read_next_batch()
        record.validate()  # buffer sizes against lengths; the per-value checks are ours, per column
    except StopIteration:
        raise WireError("the stream holds no record batch") from None
    except (pa.ArrowException, OSError) as exc:
        raise _arrow_fault("corrupt Arrow stream", exc) from None
    if record.num_rows == 0:
        raise WireError("the batch holds no events")
    arrow_schema = record.schema
    try:
        names = arrow_schema.names  # pyarrow decodes them as UTF-8
    except UnicodeDecodeError as exc:
        raise WireError(f"a column name is not valid UTF-8 (byte {exc.start})") from None
    if len(set(names)) != len(names):
        raise WireError(f"a column name appears twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
    facts = md.from_arrow(meta)
    columns = {name: _column(name, arr) for name, arr in zip(names, record.columns)}
    return Batch(columns=columns, **facts)


def _check_seal(view: memoryview, end: int, meta: dict) -> None:
    """The checksum over the bytes as received: all but its own 8 digits, which are the
    first flatbuffer string in the schema message equal to them (`seal` makes sure)."""
    raw = meta.get(md.KEY_CRC)
    if raw is None:
        raise WireError("the batch carries no checksum")
    if len(raw) != 8 or not all(c in b"0123456789abcdef" for c in raw):
        raise WireError(f"checksum {raw[:20]!r} is not 8 hex digits")
    at = bytes(view[8:end]).find(_crc_string(raw))  # the schema message is ~1 KB
    if at < 0:
        raise WireError("checksum mismatch: the checksum is not where the schema message's metadata says")
    at += 8 + 4
    crc = zlib.crc32(view[at + 8:], zlib.crc32(view[:at]))
    if crc != int(raw, 16):
        raise WireError("checksum mismatch: the batch is truncated or corrupted")
