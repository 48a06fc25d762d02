"""A walk over the encapsulated messages of an Arrow IPC stream, reading their
flatbuffer headers directly, before Arrow is given the bytes.

What Arrow does not offer safely or at all:
- the decoder: the message sequence (schema, dictionaries, one record batch,
  end) and every compressed buffer's declared uncompressed length, so a zstd
  bomb (a small buffer that inflates to gigabytes) is refused before Arrow
  allocates or decompresses anything (`read_body`);
- the encoder: where a schema metadata value's bytes sit in the serialised
  schema message, to write the checksum in place (`read_schema_message`).

Layouts are Arrow's format/Message.fbs and Schema.fbs. Every read is bounds
checked; any fault is a WireError saying where.

The walk runs on every message, in Python, so what repeats is read once: message
headers and small dictionary messages are remembered by their bytes (producers
resend the same dictionaries with every batch). Only what was accepted is
remembered; tests/test_wire_walk_memo.py checks the memo changes no verdict.
"""
from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

from fleetscope.batch import WireError

CONTINUATION = b"\xff\xff\xff\xff"
SCHEMA, DICTIONARY_BATCH, RECORD_BATCH = 1, 2, 3  # MessageHeader union tags
MAX_ROW_BYTES = 8  # the widest value a record batch column holds: int64/float64 (dictionary codes take 4)
BUFFER_SLACK = 64  # room for a buffer's padding (Arrow pads to 8 bytes, some writers to 64)
NOT_COMPRESSED = -1  # a compressed body's buffer prefix saying "stored as is"
# Dictionary messages up to this size (prefix, header and body) are walked once per distinct bytes;
# 1,024 of them remembered take at most 4 MiB.
CACHED_DICTIONARY_MESSAGE_BYTES = 4096
# Message headers (flatbuffers) up to this size are read once per distinct bytes: 2,048 take <= 2 MiB.
CACHED_HEADER_BYTES = 1024

_PREFIX = struct.Struct("<Ii")  # continuation marker, metadata length
_U8, _U16, _I32, _U32, _I64 = (struct.Struct(f) for f in ("<B", "<H", "<i", "<I", "<q"))
_U16S = [struct.Struct(f"<{n}H") for n in range(8)]  # a vtable's first n field offsets


@functools.lru_cache(maxsize=64)
def _int64s(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}q")


# Reads below run per message on the hot path, so they are plain functions over a
# memoryview: struct raises struct.error past the end (read_* turn it into a
# WireError); the one subtraction (a table's vtable) is checked for going negative.

def _fields(buf: memoryview, table: int, count: int) -> list[int]:
    """Where fields 0..count-1 of the table at `table` are; 0 for an absent one."""
    vtable = table - _I32.unpack_from(buf, table)[0]
    if vtable < 0:
        raise WireError(f"corrupt Arrow stream: a table at byte {table} points before its message header")
    n = (_U16.unpack_from(buf, vtable)[0] - 4) >> 1
    if n >= count:
        return [table + o if o else 0 for o in _U16S[count].unpack_from(buf, vtable + 4)]
    present = [table + o if o else 0 for o in _U16S[n].unpack_from(buf, vtable + 4)] if n > 0 else []
    return present + [0] * (count - len(present))


def _ref(buf: memoryview, pos: int) -> int:
    return pos + _U32.unpack_from(buf, pos)[0]


def _string(buf: memoryview, pos: int) -> tuple[int, int]:
    """(start, length) of the string the offset at `pos` points to."""
    start = _ref(buf, pos)
    length = _U32.unpack_from(buf, start)[0]
    if start + 4 + length > len(buf):
        raise WireError(f"corrupt Arrow stream: a string of {length} bytes runs past its message header")
    return start + 4, length


def _message(view: memoryview, pos: int) -> tuple[int, int, int, int, int]:
    """(kind, metadata start, metadata length, header table, body length) of the message at `pos`.

    Kind 0 is the end of stream."""
    if pos + 8 > len(view):
        if view[pos:] == b"\0\0\0\0":
            return 0, pos + 4, 0, 0, 0  # pre-1.0 end-of-stream marker
        raise WireError(f"corrupt Arrow stream: truncated message prefix at byte {pos}")
    marker, length = _PREFIX.unpack_from(view, pos)
    if marker != 0xFFFFFFFF:
        raise WireError(f"corrupt Arrow stream: no message marker at byte {pos}")
    if length == 0:
        return 0, pos + 8, 0, 0, 0
    if length < 0 or pos + 8 + length > len(view):
        raise WireError(f"corrupt Arrow stream: a message header of {length} bytes at byte {pos} runs past the end")
    if length <= CACHED_HEADER_BYTES:
        kind, header, body = _remembered_message_table(bytes(view[pos + 8:pos + 8 + length]))
    else:
        kind, header, body = _message_table(view[pos + 8:pos + 8 + length])
    if kind and not header:
        raise WireError(f"corrupt Arrow stream: the message at byte {pos} has no header")
    if body < 0 or pos + 8 + length + body > len(view):
        raise WireError(f"corrupt Arrow stream: a message body of {body} bytes at byte {pos} runs past the end")
    return kind, pos + 8, length, header, body


def _message_table(buf: memoryview) -> tuple[int, int, int]:
    """(kind, header table, body length) from a message's flatbuffer; 0 for an absent field."""
    _, kind_at, header_at, body_at = _fields(buf, _ref(buf, 0), 4)
    kind = _U8.unpack_from(buf, kind_at)[0] if kind_at else 0
    body = _I64.unpack_from(buf, body_at)[0] if body_at else 0
    header = _ref(buf, header_at) if header_at else 0
    return kind, header, body


@functools.lru_cache(maxsize=2048)
def _remembered_message_table(metadata: bytes) -> tuple[int, int, int]:
    """`_message_table` remembered by the header's bytes: a dictionary's header repeats from
    batch to batch. A header it cannot read raises struct.error and is not remembered."""
    return _message_table(memoryview(metadata))


@dataclass(frozen=True)
class SchemaMessage:
    end: int  # where the schema message ends (it has no body)
    metadata: dict[bytes, bytes]
    value_at: dict[bytes, int]  # where each metadata value's bytes start in the stream


def read_schema_message(view: memoryview) -> SchemaMessage:
    """The first message, which must be a schema: its key/value metadata and where each value lies."""
    try:
        return _read_schema_message(view)
    except struct.error as exc:
        raise WireError(f"corrupt Arrow stream: the schema message is cut short ({exc})") from None


def _read_schema_message(view: memoryview) -> SchemaMessage:
    kind, start, length, schema, body = _message(view, 0)
    if kind != SCHEMA or body:
        raise WireError(f"corrupt Arrow stream: the first message is of kind {kind}, not a schema")
    buf = view[start:start + length]
    metadata_at = _fields(buf, schema, 3)[2]
    metadata, value_at = {}, {}
    if metadata_at:
        first = _ref(buf, metadata_at)
        count = _U32.unpack_from(buf, first)[0]
        if first + 4 + 4 * count > length:
            raise WireError(f"corrupt Arrow stream: {count} metadata entries run past the schema message")
        for i in range(count):
            at = first + 4 + 4 * i
            key_pos, value_pos = _fields(buf, _ref(buf, at), 2)
            if not key_pos or not value_pos:
                raise WireError("corrupt Arrow stream: a schema metadata entry lacks its key or value")
            k, k_len = _string(buf, key_pos)
            v, v_len = _string(buf, value_pos)
            key = bytes(buf[k:k + k_len])
            if key in metadata:
                raise WireError(f"schema metadata key {key[:40]!r} appears twice")
            metadata[key] = bytes(buf[v:v + v_len])
            value_at[key] = start + v
    return SchemaMessage(start + length, metadata, value_at)


@dataclass(frozen=True)
class Body:
    rows: int  # of the record batch
    decoded_bytes: int  # all buffers of all messages, as Arrow will hold them once decompressed


def _buffers(buf: memoryview, batch: int, view: memoryview, body_at: int, body: int, per_buffer: int) -> int:
    """Bytes these buffers take once decompressed, each declared size checked against `per_buffer`."""
    _, _, buffers_at, compression_at = _fields(buf, batch, 4)
    if not buffers_at:
        return 0
    first = _ref(buf, buffers_at)
    count = _U32.unpack_from(buf, first)[0]
    if first + 4 + 16 * count > len(buf):
        raise WireError(f"corrupt Arrow stream: {count} buffers run past their message header")
    pairs = _int64s(2 * count).unpack_from(buf, first + 4)
    compressed = False
    if compression_at:
        codec_at = _fields(buf, _ref(buf, compression_at), 1)[0]
        codec = _U8.unpack_from(buf, codec_at)[0] if codec_at else 0
        if codec > 1:  # LZ4_FRAME = 0, ZSTD = 1
            raise WireError(f"corrupt Arrow stream: unknown compression codec {codec}")
        compressed = True
    total = 0
    for i in range(count):
        offset, length = pairs[2 * i], pairs[2 * i + 1]
        if offset < 0 or length < 0 or offset + length > body:
            raise WireError(f"corrupt Arrow stream: buffer {i} ({offset}+{length}) lies outside its {body}-byte body")
        size = length
        if compressed and length:
            if length < 8:
                raise WireError(f"corrupt Arrow stream: compressed buffer {i} of {length} bytes has no size prefix")
            declared = _I64.unpack_from(view, body_at + offset)[0]
            if declared == NOT_COMPRESSED:
                size = length - 8
            elif declared < 0:
                raise WireError(f"corrupt Arrow stream: buffer {i} declares {declared} bytes uncompressed")
            else:
                size = declared
        if size > per_buffer:
            raise WireError(f"decompression bomb: buffer {i} declares {size} bytes uncompressed, "
                            f"over the {per_buffer} its rows can need; refused before decompressing")
        total += size
    return total


def read_body(view: memoryview, pos: int, max_decoded_bytes: int) -> Body:
    """Walk the messages after the schema: dictionaries, then exactly one record batch, then the end.

    Each record batch buffer may declare at most MAX_ROW_BYTES per row (plus padding); all
    buffers together at most `max_decoded_bytes`. Nothing is decompressed here."""
    try:
        return _read_body(view, pos, max_decoded_bytes)
    except struct.error as exc:
        raise WireError(f"corrupt Arrow stream: a message header is cut short ({exc})") from None


def _read_body(view: memoryview, pos: int, max_decoded_bytes: int) -> Body:
    rows, total, records = 0, 0, 0
    while pos < len(view):
        kind, start, length, header, body = _message(view, pos)
        if kind == 0:
            pos = start
            break
        buf, body_at = view[start:start + length], start + length
        if kind == RECORD_BATCH:
            records += 1
            if records > 1:
                raise WireError("the stream holds more than one record batch")
            rows_at = _fields(buf, header, 1)[0]
            rows = _I64.unpack_from(buf, rows_at)[0] if rows_at else 0
            if rows < 0:
                raise WireError(f"corrupt Arrow stream: a record batch of {rows} rows")
            per_buffer = min(rows * MAX_ROW_BYTES + BUFFER_SLACK, max_decoded_bytes)
            total += _buffers(buf, header, view, body_at, body, per_buffer)
        elif kind == DICTIONARY_BATCH:
            if records:
                raise WireError("corrupt Arrow stream: a dictionary after the record batch")
            if body_at + body - pos <= CACHED_DICTIONARY_MESSAGE_BYTES:
                total += _small_dictionary_bytes(view, pos, body_at + body, max_decoded_bytes)
            else:
                total += _dictionary_bytes(view, pos, buf, header, body_at, body, max_decoded_bytes)
        else:
            raise WireError(f"corrupt Arrow stream: unexpected message of kind {kind} at byte {pos}")
        if total > max_decoded_bytes:
            raise WireError(f"decompression bomb: the buffers declare {total} bytes uncompressed, over the "
                            f"{max_decoded_bytes}-byte limit; refused before decompressing")
        pos = body_at + body
    if not records:
        raise WireError("the stream holds no record batch")
    if pos != len(view):
        raise WireError(f"corrupt Arrow stream: {len(view) - pos} bytes after the end of stream")
    return Body(rows, total)


def _dictionary_bytes(view: memoryview, pos: int, buf: memoryview, header: int, body_at: int, body: int,
                      max_decoded_bytes: int) -> int:
    """Bytes the dictionary message at `pos` declares uncompressed, each buffer checked."""
    data_at = _fields(buf, header, 2)[1]
    if not data_at:
        raise WireError(f"corrupt Arrow stream: the dictionary at byte {pos} holds no data")
    return _buffers(buf, _ref(buf, data_at), view, body_at, body, max_decoded_bytes)


def _small_dictionary_bytes(view: memoryview, pos: int, end: int, max_decoded_bytes: int) -> int:
    """`_dictionary_bytes` remembered by the message's bytes: producers resend the same few
    dictionaries (tenant, job, metric, device) with every batch, and zstd writes the same bytes
    for them each time. The walk is a function of those bytes and the limit alone; a message it
    refuses is not remembered, and is walked again in place so the error names its true position."""
    try:
        return _remembered_dictionary_bytes(bytes(view[pos:end]), max_decoded_bytes)
    except (WireError, struct.error):
        _, start, length, header, body = _message(view, pos)
        return _dictionary_bytes(view, pos, view[start:start + length], header, start + length, body,
                                 max_decoded_bytes)


@functools.lru_cache(maxsize=1024)
def _remembered_dictionary_bytes(message: bytes, max_decoded_bytes: int) -> int:
    view = memoryview(message)
    _, start, length, header, body = _message(view, 0)
    return _dictionary_bytes(view, 0, view[start:start + length], header, start + length, body, max_decoded_bytes)
