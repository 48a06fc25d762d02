"""The wire format: one Kafka message holds one batch of events from one source
on one node, as one Arrow IPC stream (arrow_wire.py), with Kafka headers that
repeat the batch's schema version, source, host, batch id and row count.

Producers build `Batch`es of numpy columns and `StrColumn`s (batch.py) and call
`encode`; workers call `decode`. The decoder's contract: whatever the bytes,
only WireError leaves it, with a one-line reason (bad magic, truncated,
checksum, future version, wrong column type, bad identity string...), so a
consumer can dead-letter the message and move on. Column types per source are
checked afterwards by schema.validate.
"""
from __future__ import annotations

from typing import Mapping

from fleetscope import arrow_wire
from fleetscope.batch import (H_BATCH, H_COUNT, H_HOST, H_SCHEMA, H_SOURCE, SCHEMA_VERSION, Batch, Column,
                              StrColumn, WireError)

__all__ = ["Batch", "Column", "StrColumn", "WireError", "SCHEMA_VERSION", "encode", "decode",
           "H_SCHEMA", "H_SOURCE", "H_HOST", "H_BATCH", "H_COUNT"]

encode = arrow_wire.encode

UNEXPECTED = "undecodable message"  # the prefix of the safety net's reason; fuzzing treats it as a bug to fix


def decode(value: bytes | memoryview | None, headers: Mapping[str, bytes] | list | None = None) -> Batch:
    """Parse and validate a batch; raise WireError, and only WireError, saying what is wrong."""
    try:
        batch = arrow_wire.decode(value)
        if headers is not None:
            _check_headers(batch, headers)
        return batch
    except WireError:
        raise
    except Exception as exc:  # noqa: BLE001 - the contract: nothing but WireError escapes the decoder
        detail = (str(exc).strip().splitlines() or [""])[0][:200]
        raise WireError(f"{UNEXPECTED} ({type(exc).__name__}: {detail})") from None


def _check_headers(batch: Batch, headers) -> None:
    try:
        h = headers if isinstance(headers, Mapping) else dict(headers)
    except (TypeError, ValueError):
        raise WireError("Kafka headers are not a list of (name, value) pairs") from None
    expected = {H_SCHEMA: str(SCHEMA_VERSION), H_SOURCE: batch.source, H_HOST: batch.host,
                H_BATCH: batch.batch_id, H_COUNT: str(batch.count)}
    for key, want in expected.items():
        got = h.get(key)
        if got is None:
            continue  # headers are an optimisation for routers; the payload is authoritative
        got = got.decode(errors="replace") if isinstance(got, (bytes, bytearray)) else str(got)
        if got != want:
            raise WireError(f"header {key}={got[:80]!r} disagrees with the payload ({want!r})")
