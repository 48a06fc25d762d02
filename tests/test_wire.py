import struct
import zlib

import numpy as np
import pytest

from fleetscope import wire
from fleetscope.schema import node_identity, validate
from fleetscope.wire import Batch, StrColumn, WireError, decode, encode


def metric_batch(n=5, source="host"):
    cols = {"ts_ns": np.arange(n, dtype="<i8") + 1_700_000_000_000_000_000, **node_identity("node-a", n),
            "metric": StrColumn.of(["cpu.user", "cpu.idle"] * (n // 2) + ["cpu.user"] * (n % 2)),
            "device": StrColumn.constant("all", n), "value": np.linspace(0, 1, n),
            "interval_ns": np.full(n, 10**9, dtype="<i8")}
    return Batch(source, "node-a", cols, extras={"sampling_fraction": 0.5})


def test_round_trip_keeps_every_column_value_and_header_fact():
    batch = metric_batch(7)
    out = decode(encode(batch), batch.kafka_headers())
    assert (out.source, out.host, out.batch_id, out.count, out.extras) == \
        ("host", "node-a", batch.batch_id, 7, {"sampling_fraction": 0.5})
    for name, col in batch.columns.items():
        got = out.columns[name]
        if isinstance(col, StrColumn):
            assert list(got.to_numpy()) == list(col.to_numpy())
        else:
            assert got.dtype == col.dtype and np.array_equal(got, col)
    validate(out)


def test_headers_carry_schema_source_host_batch_and_count():
    batch = metric_batch(3)
    assert dict(batch.kafka_headers()) == {"fs-schema": b"1", "fs-source": b"host", "fs-host": b"node-a",
                                           "fs-batch": batch.batch_id.encode(), "fs-count": b"3"}


def test_garbage_is_rejected_as_not_a_batch():
    with pytest.raises(WireError, match="bad magic"):
        decode(b"hello world, this is not a batch at all")


def test_truncated_batch_is_rejected_by_checksum():
    data = encode(metric_batch(10))
    with pytest.raises(WireError, match="truncated or corrupted"):
        decode(data[:-9])


def test_future_schema_version_is_rejected_with_upgrade_hint():
    data = bytearray(encode(metric_batch(2)))
    struct.pack_into("<H", data, 4, wire.SCHEMA_VERSION + 1)
    with pytest.raises(WireError, match="newer than this worker supports"):
        decode(bytes(data))


def _reseal(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def test_column_with_wrong_length_is_rejected_even_with_valid_checksum():
    data = encode(metric_batch(4))[:-4]
    # claim 5 rows while columns hold 4
    body = bytearray(data)
    struct.pack_into("<I", body, 8, 5)
    with pytest.raises(WireError, match="is not 5 rows"):
        decode(_reseal(bytes(body)))


def test_header_that_disagrees_with_payload_is_rejected():
    batch = metric_batch(2)
    headers = dict(batch.kafka_headers())
    headers["fs-count"] = b"99"
    with pytest.raises(WireError, match="fs-count"):
        decode(encode(batch), headers)


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


def test_unknown_source_is_rejected():
    with pytest.raises(WireError, match="unknown source"):
        validate(decode(encode(metric_batch(2, source="martian"))))


def test_string_code_outside_dictionary_is_rejected():
    batch = metric_batch(2)
    batch.columns["device"] = StrColumn(np.array([0, 3], dtype=np.uint32), ("all",))
    with pytest.raises(WireError, match="outside a dictionary"):
        decode(encode(batch))


def test_none_value_is_rejected():
    with pytest.raises(WireError, match="no value"):
        decode(None)
