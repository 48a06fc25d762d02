"""The raw wire format: one Arrow IPC stream per message, and a decoder from which
only WireError escapes, each with a precise one-line reason."""
import numpy as np
import pyarrow as pa
import pytest
from support.wire_messages import metric_batch, record_of, replace_column, reseal, sealed, with_meta

from fleetscope import wire
from fleetscope.schema import validate
from fleetscope.wire import Batch, StrColumn, WireError, decode, encode


def rejects(data, match, headers=None) -> str:
    """decode refuses `data` with WireError matching `match`, and not through the safety net."""
    with pytest.raises(WireError, match=match) as caught:
        decode(data, headers)
    reason = str(caught.value)
    assert not reason.startswith(wire.UNEXPECTED) and "\n" not in reason, reason
    return reason


def test_round_trip_keeps_every_column_value_and_header_fact():
    batch = metric_batch(7)
    out = decode(encode(batch), batch.kafka_headers())
    assert (out.source, out.host, out.batch_id, out.count, out.extras) == \
        ("host", "node-a", batch.batch_id, 7, {"sampling_fraction": 0.5})
    for name, col in batch.columns.items():
        got = out.columns[name]
        if isinstance(col, StrColumn):
            assert got.values == col.values and np.array_equal(got.codes, col.codes)
        else:
            assert got.dtype == col.dtype and np.array_equal(got, col)
    validate(out)


def test_message_is_a_plain_arrow_stream_with_dictionary_strings_and_zstd():
    batch = metric_batch(1000)
    data = encode(batch)
    reader = pa.ipc.open_stream(data)
    record = reader.read_all()
    assert record.num_rows == 1000
    assert record.schema.field("metric").type == pa.dictionary(pa.uint32(), pa.string())
    assert record.schema.metadata[b"fleetscope.host"] == b"node-a"
    assert len(data) < len(sealed(record_of(batch), compression=None)), "zstd makes the message smaller"


def test_chdb_reads_the_raw_message_as_arrow_stream(tmp_path):
    """The point of Arrow on the wire: ClickHouse ingests a raw message as it is."""
    chdb = pytest.importorskip("chdb")
    batch = metric_batch(100, host="node-b")
    path = tmp_path / "raw.arrow"
    path.write_bytes(encode(batch))
    got = chdb.query(f"SELECT count(), round(sum(value), 6), any(job), groupUniqArray(metric), min(ts_ns) "
                     f"FROM file('{path}', 'ArrowStream')", "JSONCompact").bytes()
    import json
    row = json.loads(got)["data"][0]
    assert row[0] == 100 and row[1] == round(float(batch.columns["value"].sum()), 6) and row[2] == "node-b"
    assert sorted(row[3]) == ["cpu.idle", "cpu.user"] and int(row[4]) == 1_700_000_000_000_000_000


def test_headers_carry_schema_source_host_batch_and_count():
    batch = metric_batch(3)
    assert dict(batch.kafka_headers()) == {"fs-schema": b"2", "fs-source": b"host", "fs-host": b"node-a",
                                           "fs-batch": batch.batch_id.encode(), "fs-count": b"3"}


def test_garbage_is_rejected_as_not_a_batch():
    rejects(b"hello world, this is not a batch at all", "bad magic")


def test_arrow_stream_without_fleetscope_metadata_is_not_a_batch():
    record = record_of(metric_batch(3)).replace_schema_metadata({})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, record.schema) as w:
        w.write_batch(record)
    rejects(sink.getvalue().to_pybytes(), "bad magic: an Arrow stream without fleetscope metadata")


def test_every_truncation_is_rejected():
    data = encode(metric_batch(10))
    for cut in range(len(data)):
        rejects(data[:cut], "truncated|checksum|bad schema message|corrupt")


def test_every_single_bit_flip_is_rejected_or_harmless():
    """Arrow alone decoded most flipped messages into other values; the checksum catches them."""
    batch = metric_batch(10)
    data = encode(batch)
    for pos in range(len(data)):
        flipped = bytearray(data)
        flipped[pos] ^= 1 << (pos % 8)
        try:
            out = decode(bytes(flipped))
        except WireError as exc:
            assert not str(exc).startswith(wire.UNEXPECTED), exc
            continue
        # a flip in padding the parser never reads leaves the batch unchanged
        assert out.batch_id == batch.batch_id and np.array_equal(out.columns["value"], batch.columns["value"])


def test_future_schema_version_is_rejected_with_upgrade_hint():
    rejects(sealed(with_meta(record_of(metric_batch(2)), version=b"3")), "newer than this worker supports")


def test_retired_schema_version_is_rejected():
    rejects(sealed(with_meta(record_of(metric_batch(2)), version=b"1")), "older than the oldest")


def test_missing_checksum_is_rejected():
    record = record_of(metric_batch(2))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, record.schema) as w:
        w.write_batch(record)
    rejects(sink.getvalue().to_pybytes(), "carries no checksum")


def test_header_that_disagrees_with_payload_is_rejected():
    batch = metric_batch(2)
    headers = dict(batch.kafka_headers())
    headers["fs-count"] = b"99"
    rejects(encode(batch), "fs-count", headers)


def test_malformed_headers_are_a_wire_error():
    rejects(encode(metric_batch(2)), "not a list of", headers=[1, 2, 3])


def test_non_bytes_value_is_a_wire_error():
    rejects("a string", "not bytes")
    rejects(None, "no value")


def test_two_record_batches_are_rejected():
    record = record_of(metric_batch(2))
    rejects(sealed(record, record), "more than one record batch")


def test_empty_record_batch_is_rejected():
    rejects(sealed(record_of(metric_batch(2)).slice(0, 0)), "no events")


def test_nulls_are_rejected():
    record = record_of(metric_batch(3))
    rejects(sealed(replace_column(record, "value", pa.array([1.0, None, 2.0]), nullable=True)), "nulls")


def test_unsupported_arrow_type_is_rejected():
    record = record_of(metric_batch(3))
    rejects(sealed(replace_column(record, "value", pa.array(["a", "b", "c"]))), "unsupported Arrow type string")


def test_dictionary_with_signed_indices_is_rejected():
    record = record_of(metric_batch(3))
    arr = pa.DictionaryArray.from_arrays(pa.array([0, 0, 0], pa.int8()), pa.array(["all"]))
    rejects(sealed(replace_column(record, "device", arr)), "int8 indices, expected uint32")


def test_string_code_outside_dictionary_is_rejected_by_encoder_and_decoder():
    batch = metric_batch(2)
    batch.columns["device"] = StrColumn(np.array([0, 3], dtype=np.uint32), ("all",))
    with pytest.raises(WireError, match="outside a dictionary"):
        encode(batch)
    record = record_of(metric_batch(2))
    bad = pa.DictionaryArray.from_arrays(pa.array([0, 3], pa.uint32()), pa.array(["all"]), safe=False)
    rejects(sealed(replace_column(record, "device", bad)), "corrupt Arrow stream")


@pytest.mark.parametrize("created", [b"nan", b"NaN", b"Infinity", b"-inf", b"1e9", b"9" * 20, b"", b"0x10", b" 1"])
def test_created_ns_that_is_not_an_int64_is_rejected(created):
    rejects(sealed(with_meta(record_of(metric_batch(2)), created_ns=created)), "created_ns .* is not a 64-bit integer")


@pytest.mark.parametrize("extras, match", [
    (b"[" * 100_000 + b"]" * 100_000, "over the 4096-byte limit"),
    (b"[" * 2000 + b"]" * 2000, "nested too deeply"),
    (b'{"a":{"b":1}}', "is nested"),
    (b'{"a":NaN}', "only finite numbers"),
    (b'{"a":1e999}', "not finite"),
    (b'[1,2]', "JSON list, not an object"),
    (b'{"a":', "not valid JSON"),
    (b'{"a":"\xff"}', "not valid UTF-8"),
])
def test_bad_extras_are_rejected(extras, match):
    rejects(sealed(with_meta(record_of(metric_batch(2)), extras=extras)), match)


@pytest.mark.parametrize("fact", ["source", "host", "batch_id"])
def test_missing_or_mistyped_fact_is_rejected(fact):
    record = record_of(metric_batch(2))
    rejects(sealed(with_meta(record, **{fact: None})), f"lacks {fact}")
    rejects(sealed(with_meta(record, **{fact: b""})), f"{fact} is empty")


def test_lone_surrogate_host_is_rejected_by_encoder_and_decoder():
    """A host with a lone surrogate once passed the decoder and then failed every insert."""
    batch = metric_batch(2)
    batch.host = "node-\ud800"
    with pytest.raises(WireError, match="surrogate"):
        encode(batch)
    # the same host as UTF-8 would spell it (CESU bytes), sealed by hand
    rejects(sealed(with_meta(record_of(metric_batch(2)), host="node-\ud800".encode("utf-8", "surrogatepass"))),
            "host is not valid UTF-8")


@pytest.mark.parametrize("column", ["tenant", "job"])
@pytest.mark.parametrize("value, match", [("a\x07b", "control character"), ("line\nbreak", "control character"),
                                          ("c1\x85", "control character"), ("x" * 257, "over the 256-byte limit")])
def test_bad_identity_strings_in_columns_are_rejected(column, value, match):
    batch = metric_batch(2)
    batch.columns[column] = StrColumn.constant(value, 2)
    rejects(encode(batch), f"column '{column}' value .*{match}")


def test_invalid_utf8_in_an_identity_dictionary_is_rejected():
    record = record_of(metric_batch(2))
    raw = pa.Array.from_buffers(pa.string(), 1, [None, pa.py_buffer(np.array([0, 3], "<i4").tobytes()),
                                                 pa.py_buffer(b"\xed\xa0\x80")])
    bad = pa.DictionaryArray.from_arrays(pa.array([0, 0], pa.uint32()), raw)
    rejects(sealed(replace_column(record, "tenant", bad)), "(?i)utf-?8")


def test_good_identity_with_unicode_and_punctuation_passes():
    batch = metric_batch(2, host="gpu-node-7.rack-3.example")
    batch.columns["job"] = StrColumn.constant("训练/llama-70b:run#2", 2)
    assert decode(encode(batch)).columns["job"].values == ("训练/llama-70b:run#2",)


def test_oversized_message_is_rejected_before_parsing():
    rejects(b"\xff\xff\xff\xff" + b"\0" * (wire.arrow_wire.MAX_MESSAGE_BYTES + 1), "over the .*-byte limit")


def test_huge_schema_length_is_truncation():
    rejects(b"\xff\xff\xff\xff\x00\x00\x00\x70" + b"\0" * 64, "truncated")


def test_mutated_body_with_fixed_checksum_is_still_a_wire_error():
    """Behind a valid checksum, Arrow's structural errors also come out as WireError."""
    data = encode(metric_batch(20))
    rejects(reseal(data[:-40]), "corrupt Arrow stream")


def test_empty_batch_is_never_encoded():
    with pytest.raises(WireError, match="at least one event"):
        encode(Batch("host", "n", {"ts_ns": np.empty(0, dtype="<i8")}))


def test_columns_of_unequal_length_are_refused():
    with pytest.raises(WireError, match="differ in length"):
        Batch("host", "n", {"a": np.zeros(2), "b": np.zeros(3)})


def test_schema_validation_names_the_missing_column():
    batch = metric_batch(2)
    del batch.columns["value"]
    with pytest.raises(WireError, match="lacks column 'value'"):
        validate(decode(encode(batch)))


def test_schema_validation_names_a_wrongly_typed_column():
    batch = metric_batch(2)
    batch.columns["ts_ns"] = batch.columns["ts_ns"].astype("<f8")
    with pytest.raises(WireError, match="'ts_ns' must be int64, got float64"):
        validate(decode(encode(batch)))


def test_unknown_source_is_rejected():
    with pytest.raises(WireError, match="unknown source"):
        validate(decode(encode(metric_batch(2, source="martian"))))


# ---- decompression bombs: a valid checksum over a small message whose buffers inflate to gigabytes ----

def zstd_zeros(size: int) -> bytes:
    """A real zstd frame of `size` zero bytes (512 MiB fit in ~16 KB), built in 1 MiB steps."""
    sink = pa.BufferOutputStream()
    chunk = bytes(1 << 20)
    with pa.CompressedOutputStream(sink, "zstd") as out:
        for _ in range(size >> 20):
            out.write(chunk)
        out.write(bytes(size & ((1 << 20) - 1)))
    return sink.getvalue().to_pybytes()


def replace_once(data: bytes, old: bytes, new: bytes) -> bytes:
    assert data.count(old) == 1, f"pattern {old.hex()} appears {data.count(old)} times"
    return data.replace(old, new)


def bomb(inflated: int, columns: int = 1, claimed_rows: int | None = None) -> bytes:
    """A sealed message of 7-row float64 columns whose data buffers are each a zstd frame of
    `inflated` zero bytes, declared honestly; `claimed_rows` rewrites the row count too.

    Built from pyarrow's own message by swapping each buffer for the bomb and patching the
    buffer table and body length in the record batch's flatbuffer (same-size int64 fields)."""
    import struct
    rows = 7
    base = record_of(metric_batch(2))
    record = pa.RecordBatch.from_arrays([pa.array(np.zeros(rows)) for _ in range(columns)],
                                        names=[f"v{i}" for i in range(columns)]).replace_schema_metadata(base.schema.metadata)
    data = sealed(record)
    small = 8 + len(pa.Codec("zstd").compress(np.zeros(rows).tobytes(), asbytes=True))  # as pyarrow wrote each buffer
    big_frame = struct.pack("<q", inflated) + zstd_zeros(inflated)
    big = len(big_frame)
    align = lambda n: (n + 7) & ~7  # noqa: E731
    end = wire.arrow_wire.schema_end(memoryview(data))
    meta_len = struct.unpack_from("<i", data, end + 4)[0]
    meta, body_at = data[end + 8:end + 8 + meta_len], end + 8 + meta_len
    for i in range(columns):
        meta = replace_once(meta, struct.pack("<qq", i * align(small), small), struct.pack("<qq", i * align(big), big))
    meta = replace_once(meta, struct.pack("<q", columns * align(small)), struct.pack("<q", columns * align(big)))
    if claimed_rows is not None:
        assert meta.count(struct.pack("<q", rows)) == columns + 1  # the batch's length and each column's
        meta = meta.replace(struct.pack("<q", rows), struct.pack("<q", claimed_rows))
    padded = big_frame + b"\0" * (align(big) - big)
    eos = data[body_at + columns * align(small):]
    return reseal(data[:end + 8] + meta + padded * columns + eos)


def test_a_buffer_inflating_past_what_its_rows_need_is_refused_before_decompressing():
    """512 MiB of zeros in ~16 KB, behind a valid checksum, in a batch of 7 rows (56 bytes a column)."""
    pool = pa.default_memory_pool()
    before = pool.max_memory()
    rejects(bomb(512 << 20), "decompression bomb: buffer 1 declares 536870912 bytes uncompressed, over the 120")
    assert pool.max_memory() - before < 16 << 20  # Arrow never allocated the 512 MiB


def test_buffers_inflating_past_the_global_cap_are_refused_before_decompressing():
    """Two 192 MiB buffers with a forged row count that would allow them one by one."""
    pool = pa.default_memory_pool()
    before = pool.max_memory()
    rejects(bomb(192 << 20, columns=2, claimed_rows=1 << 40), "decompression bomb: the buffers declare 402653184 "
            f"bytes uncompressed, over the {wire.arrow_wire.MAX_DECODED_BYTES}-byte limit")
    assert pool.max_memory() - before < 16 << 20


def test_a_bomb_under_both_bounds_is_decoded_within_them():
    """The check is a bound, not a ban on compression: 7 rows of zeros declared honestly decode."""
    batch = decode(bomb(56))
    assert batch.count == 7 and not batch.columns["v0"].any()


def test_a_schema_string_that_looks_like_the_checksum_placeholder_still_round_trips():
    """The encoder writes the checksum where a placeholder "00000000" was; a host and a column
    with that very name make the placeholder ambiguous, so it must find the right one."""
    cols = dict(metric_batch(3, host="00000000").columns, **{"00000000": np.arange(3, dtype="<i8")})
    batch = Batch("host", "00000000", cols)
    back = decode(encode(batch))
    assert back.host == "00000000" and back.columns["00000000"].tolist() == [0, 1, 2]
