"""Hand-made raw messages for decoder tests: valid Arrow IPC streams, sealed with a
correct checksum, whose content breaks one rule, so the test reaches the check
behind the checksum."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from fleetscope import arrow_wire, wire_metadata
from fleetscope.schema import node_identity
from fleetscope.wire import Batch, StrColumn, encode


def metric_batch(n=5, source="host", host="node-a") -> Batch:
    cols = {"ts_ns": np.arange(n, dtype="<i8") + 1_700_000_000_000_000_000, **node_identity(host, n),
            "metric": StrColumn.of(["cpu.user", "cpu.idle"] * (n // 2) + ["cpu.user"] * (n % 2)),
            "device": StrColumn.constant("all", n), "value": np.linspace(0, 1, n),
            "interval_ns": np.full(n, 10**9, dtype="<i8")}
    return Batch(source, host, cols, extras={"sampling_fraction": 0.5})


def record_of(batch: Batch) -> pa.RecordBatch:
    """The batch as the Arrow record batch its message holds, metadata without the checksum."""
    record = pa.ipc.open_stream(encode(batch)).read_next_batch()
    meta = {k: v for k, v in record.schema.metadata.items() if k != wire_metadata.KEY_CRC}
    return record.replace_schema_metadata(meta)


def with_meta(record: pa.RecordBatch, **changes: bytes | None) -> pa.RecordBatch:
    """Change metadata facts by their short name (host=b"x", created_ns=b"nan"); None removes one."""
    meta = dict(record.schema.metadata)
    for short, value in changes.items():
        key = f"fleetscope.{short}".encode()
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    return record.replace_schema_metadata(meta)


def sealed(*records: pa.RecordBatch, compression: str | None = "zstd") -> bytes:
    """An Arrow IPC stream of these record batches with a correct fleetscope checksum."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, records[0].schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as w:
        for record in records:
            w.write_batch(record)
    view = memoryview(sink.getvalue())
    end = arrow_wire.schema_end(view)
    return arrow_wire.seal(view[:end], view[end:], records[0].schema)


def reseal(message: bytes) -> bytes:
    """Recompute the checksum of a message whose schema message still parses (after a mutation)."""
    view = memoryview(message)
    end = arrow_wire.schema_end(view)
    schema = pa.ipc.read_schema(pa.py_buffer(view[:end]))
    unsealed = schema.with_metadata({k: v for k, v in (schema.metadata or {}).items() if k != wire_metadata.KEY_CRC})
    return arrow_wire.seal(unsealed.serialize(), view[end:], unsealed)


def replace_column(record: pa.RecordBatch, name: str, array: pa.Array, nullable: bool = False) -> pa.RecordBatch:
    i = record.schema.get_field_index(name)
    schema = record.schema.set(i, pa.field(name, array.type, nullable=nullable))
    arrays = [array if j == i else record.column(j) for j in range(record.num_columns)]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
