"""Malformed raw messages, for fuzzing the decoder and for chaos runs that mix bad
messages into valid traffic.

`mutants(rng)` yields (strategy, bytes) built from valid messages of several
shapes: random bytes, truncations, bit flips with and without a fixed
checksum (resealed, so the mutation reaches the Arrow parser behind it),
oversized length fields, spliced chunks, and hostile metadata (deep or NaN
JSON, non-integer times, invalid UTF-8, control characters) sealed with a
correct checksum. `check(data)` decodes one and returns a failure description
when the decoder broke its contract: anything but WireError escaped, or the
safety net's generic reason was needed.
"""
from __future__ import annotations

import random
import struct
import uuid

import numpy as np
import pyarrow as pa

from fleetscope import arrow_wire, wire_metadata
from fleetscope.wire import UNEXPECTED, Batch, StrColumn, WireError, decode, encode

HOSTILE_META = {
    wire_metadata.KEY_CREATED: [b"nan", b"Infinity", b"-1e309", b"9" * 40, b"", b"1.5", b"\xff", b"-" * 3],
    wire_metadata.KEY_EXTRAS: [b"[" * 5000, b"{" * 3000, b'{"a":' * 1500 + b"1" + b"}" * 1500, b"[" * 900 + b"]" * 900,
                               b'{"a":NaN}', b'{"a":-Infinity}', b'{"a":1e999}', b"null", b'"x"', b'{"a":[1]}',
                               b'{"\\ud800":1}', b"\xfe\xff", b"\x00{}", b'{"a":1' ],
    wire_metadata.KEY_HOST: [b"", b"\xed\xa0\x80", b"a\x00b", b"x" * 300, b"\xc3", b"ok\x1b[31m"],
    wire_metadata.KEY_SOURCE: [b"", b"\xff", b"host\n"],
    wire_metadata.KEY_BATCH: [b"", b"\x80" * 3],
    wire_metadata.KEY_VERSION: [b"", b"-1", b"0", b"1", b"3", b"99999999999", b"\xd9\xa3", b"2 "],
    wire_metadata.KEY_CRC: [b"", b"zzzzzzzz", b"0" * 9, b"\xff" * 8],
}


def sample_batch(rng: random.Random) -> Batch:
    """A valid batch of random shape: 1..300 rows, a few string and numeric columns."""
    n = rng.randint(1, 300)
    nrng = np.random.default_rng(rng.getrandbits(32))
    metrics = tuple(f"m.{i}" for i in range(rng.randint(1, 20)))
    cols = {"ts_ns": nrng.integers(1_600_000_000_000_000_000, 1_800_000_000_000_000_000, n).astype("<i8"),
            "tenant": StrColumn.constant(rng.choice(["_node", "team-a", "研究"]), n),
            "job": StrColumn.constant(f"job-{rng.randint(0, 9)}", n),
            "rank": nrng.integers(-1, 64, n).astype("<i4"), "pid": nrng.integers(0, 1 << 22, n).astype("<i4"),
            "gpu": nrng.integers(-1, 8, n).astype("<i2"),
            "metric": StrColumn(nrng.integers(0, len(metrics), n).astype(np.uint32), metrics),
            "device": StrColumn.constant("all", n), "value": nrng.random(n),
            "interval_ns": np.full(n, 10**9, dtype="<i8")}
    if rng.random() < 0.3:
        cols["sample_frac"] = nrng.random(n)
    return Batch(rng.choice(["host", "cuda", "nvml"]), f"node-{rng.randint(0, 99)}", cols,
                 batch_id=uuid.UUID(int=rng.getrandbits(128)).hex, created_ns=rng.getrandbits(62),
                 extras={"sampling_fraction": rng.random()} if rng.random() < 0.5 else {})


def _reseal(data: bytes) -> bytes:
    """Recompute the checksum over a mutated message, when its schema message still parses."""
    try:
        view = memoryview(data)
        end = arrow_wire.schema_end(view)
        schema = pa.ipc.read_schema(pa.py_buffer(view[:end]))
    except (WireError, pa.ArrowException, OSError):
        return data
    meta = {k: v for k, v in (schema.metadata or {}).items() if k != wire_metadata.KEY_CRC}
    unsealed = schema.with_metadata(meta)
    return arrow_wire.seal(unsealed.serialize(), view[end:], unsealed)


def _hostile_meta(rng: random.Random, valid: bytes) -> bytes:
    record = pa.ipc.open_stream(valid).read_next_batch()
    meta = {k: v for k, v in record.schema.metadata.items() if k != wire_metadata.KEY_CRC}
    for key in rng.sample(sorted(HOSTILE_META), rng.randint(1, 3)):
        if rng.random() < 0.15:
            meta.pop(key, None)
        else:
            meta[key] = rng.choice(HOSTILE_META[key])
    schema = record.schema.with_metadata(meta)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_batch(record.replace_schema_metadata(meta))
    out = sink.getvalue().to_pybytes()
    return out if wire_metadata.KEY_CRC in meta else _reseal(out)


def _flip(rng: random.Random, data: bytes, lo: int = 0) -> bytes:
    out = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 3, 8))):
        pos = rng.randrange(lo, len(out))
        out[pos] ^= 1 << rng.randrange(8)
    return bytes(out)


def _oversize(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    pos = rng.choice([4, rng.randrange(0, max(1, len(out) - 8)) & ~3])
    struct.pack_into("<I", out, pos, rng.choice([0x7FFFFFFF, 0xFFFFFFFF, 0x80000000, 1 << 30, len(out) + 8, 0xFFFFFFF8]))
    return bytes(out)


def _splice(rng: random.Random, data: bytes) -> bytes:
    a, b = sorted(rng.randrange(len(data)) for _ in range(2))
    chunk = data[a:b]
    choice = rng.randrange(3)
    if choice == 0:
        return data[:a] + data[b:]  # delete
    if choice == 1:
        return data[:b] + chunk + data[b:]  # duplicate
    return data[:a] + bytes(rng.getrandbits(8) for _ in range(min(len(chunk), 64))) + data[a + 64:]


STRATEGIES = ("random_bytes", "truncate", "flip", "flip_resealed", "oversize", "oversize_resealed",
              "splice", "splice_resealed", "hostile_meta", "valid")


def mutant(rng: random.Random, valid: bytes) -> tuple[str, bytes]:
    """One malformed message derived from `valid`, and the strategy that made it."""
    strategy = rng.choice(STRATEGIES)
    if strategy == "random_bytes":
        prefix = arrow_wire.CONTINUATION if rng.random() < 0.5 else b""
        return strategy, prefix + bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 600)))
    if strategy == "truncate":
        return strategy, valid[:rng.randrange(len(valid))]
    if strategy == "flip":
        return strategy, _flip(rng, valid)
    if strategy == "flip_resealed":
        end = arrow_wire.schema_end(memoryview(valid))
        return strategy, _reseal(_flip(rng, valid, lo=end if rng.random() < 0.8 else 0))
    if strategy.startswith("oversize"):
        out = _oversize(rng, valid)
        return strategy, _reseal(out) if strategy.endswith("resealed") else out
    if strategy.startswith("splice"):
        out = _splice(rng, valid)
        return strategy, _reseal(out) if strategy.endswith("resealed") else out
    if strategy == "hostile_meta":
        return strategy, _hostile_meta(rng, valid)
    return strategy, valid


def check(data: bytes) -> str | None:
    """None when the decoder kept its contract on `data`; else what went wrong."""
    try:
        batch = decode(data)
    except WireError as exc:
        reason = str(exc)
        if reason.startswith(UNEXPECTED) or "\n" in reason:
            return f"imprecise reason: {reason}"
        return None
    except BaseException as exc:  # noqa: BLE001 - finding these is the point
        return f"{type(exc).__name__} escaped the decoder: {str(exc)[:200]}"
    lengths = {len(col) for col in batch.columns.values()}
    if lengths != {batch.count}:
        return f"accepted a batch with column lengths {sorted(lengths)}"
    try:
        encode(batch)
    except WireError:
        pass
    except Exception as exc:  # noqa: BLE001
        return f"an accepted batch does not re-encode: {type(exc).__name__}: {exc}"
    return None


def fuzz(inputs: int, seed: int, on_failure=None) -> dict:
    """Run `inputs` mutants; returns counts by strategy and outcome, and the failures."""
    rng = random.Random(seed)
    seeds = [encode(sample_batch(rng)) for _ in range(16)]
    counts: dict[str, dict[str, int]] = {s: {"accepted": 0, "rejected": 0, "failed": 0} for s in STRATEGIES}
    failures = []
    for _ in range(inputs):
        strategy, data = mutant(rng, rng.choice(seeds))
        problem = check(data)
        if problem is None:
            try:
                decode(data)
                counts[strategy]["accepted"] += 1
            except WireError:
                counts[strategy]["rejected"] += 1
            continue
        counts[strategy]["failed"] += 1
        failures.append((strategy, data, problem))
        if on_failure is not None:
            on_failure(strategy, data, problem)
    return {"inputs": inputs, "seed": seed, "by_strategy": counts, "failures": failures}
