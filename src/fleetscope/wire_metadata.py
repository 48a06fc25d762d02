"""The batch facts a message carries beside its columns, and the rules on the
identity strings that end up in every stored row.

The facts travel as the Arrow schema's key/value metadata (bytes to bytes), so
each is parsed strictly here: an integer is decimal digits, extras are a small
flat JSON object of finite scalars. Nothing in this module lets a ValueError,
TypeError, OverflowError or RecursionError out; every fault is a WireError
naming the field.
"""
from __future__ import annotations

import json
import math
import re

from fleetscope.batch import Batch, WireError

KEY_VERSION = b"fleetscope.version"
KEY_CRC = b"fleetscope.crc32"
KEY_SOURCE = b"fleetscope.source"
KEY_HOST = b"fleetscope.host"
KEY_BATCH = b"fleetscope.batch_id"
KEY_CREATED = b"fleetscope.created_ns"
KEY_EXTRAS = b"fleetscope.extras"

IDENTITY_MAX_BYTES = 256  # tenant, job, host: a DNS name is <= 253; Kubernetes names are shorter
EXTRAS_MAX_BYTES = 4096
IDENTITY_COLUMNS = ("tenant", "job", "host")  # string columns whose values name who an event belongs to
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # C0, DEL and C1: they break logs, SQL literals and keys
_INT64 = re.compile(rb"-?[0-9]{1,19}")
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def check_identity(what: str, value: str) -> None:
    """Raise WireError unless `value` may name a tenant, job or host in stored rows."""
    if not value:
        raise WireError(f"{what} is empty")
    try:
        size = len(value.encode())
    except UnicodeEncodeError:
        raise WireError(f"{what} {value!r} is not valid Unicode (a lone surrogate)") from None
    if size > IDENTITY_MAX_BYTES:
        raise WireError(f"{what} is {size} bytes long, over the {IDENTITY_MAX_BYTES}-byte limit")
    bad = _CONTROL.search(value)
    if bad:
        raise WireError(f"{what} {value!r} contains control character {bad.group()!r}")


def to_arrow(batch: Batch, version: int) -> dict[bytes, bytes]:
    """The batch's facts as Arrow schema metadata (the checksum is added by the framing)."""
    try:
        extras = json.dumps(batch.extras, separators=(",", ":"), allow_nan=False) if batch.extras else "{}"
        return {KEY_VERSION: str(version).encode(), KEY_SOURCE: batch.source.encode(),
                KEY_HOST: batch.host.encode(), KEY_BATCH: batch.batch_id.encode(),
                KEY_CREATED: str(int(batch.created_ns)).encode(), KEY_EXTRAS: extras.encode()}
    except (UnicodeEncodeError, AttributeError) as exc:
        raise WireError(f"batch metadata cannot be encoded: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise WireError(f"batch extras must be a flat JSON object of finite scalars: {exc}") from None


def version_of(meta: dict[bytes, bytes] | None) -> int:
    if not meta or KEY_VERSION not in meta:
        raise WireError("bad magic: an Arrow stream without fleetscope metadata, not a fleetscope batch")
    raw = meta[KEY_VERSION]
    if not raw.isdigit() or len(raw) > 5:
        raise WireError(f"schema version {raw[:20]!r} is not a number")
    return int(raw)


def _text(meta: dict[bytes, bytes], key: bytes, what: str) -> str:
    raw = meta.get(key)
    if raw is None:
        raise WireError(f"metadata lacks {what}")
    try:
        return raw.decode()
    except UnicodeDecodeError as exc:
        raise WireError(f"metadata {what} is not valid UTF-8 (byte {exc.start})") from None


def from_arrow(meta: dict[bytes, bytes]) -> dict:
    """Parse the facts back; raise WireError naming the first bad one."""
    source = _text(meta, KEY_SOURCE, "source")
    host = _text(meta, KEY_HOST, "host")
    batch_id = _text(meta, KEY_BATCH, "batch_id")
    check_identity("source", source)
    check_identity("host", host)
    check_identity("batch_id", batch_id)
    created = meta.get(KEY_CREATED, b"0")
    if not _INT64.fullmatch(created) or not _INT64_MIN <= int(created) <= _INT64_MAX:
        raise WireError(f"metadata created_ns {created[:40]!r} is not a 64-bit integer")
    return {"source": source, "host": host, "batch_id": batch_id, "created_ns": int(created),
            "extras": _extras(meta.get(KEY_EXTRAS, b"{}"))}


def _reject_constant(name: str):
    raise WireError(f"metadata extras hold {name}; only finite numbers are allowed")


def _extras(raw: bytes) -> dict:
    if len(raw) > EXTRAS_MAX_BYTES:
        raise WireError(f"metadata extras are {len(raw)} bytes, over the {EXTRAS_MAX_BYTES}-byte limit")
    try:
        text = raw.decode()  # strictly UTF-8 (json.loads of bytes would also guess UTF-16/32)
    except UnicodeDecodeError as exc:
        raise WireError(f"metadata extras are not valid UTF-8 (byte {exc.start})") from None
    try:
        extras = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise WireError("metadata extras are nested too deeply to parse") from None
    except json.JSONDecodeError as exc:
        raise WireError(f"metadata extras are not valid JSON: {exc.msg} at byte {exc.pos}") from None
    if not isinstance(extras, dict):
        raise WireError(f"metadata extras are a JSON {type(extras).__name__}, not an object")
    for key, value in extras.items():
        if isinstance(value, (dict, list)):
            raise WireError(f"metadata extras[{key[:40]!r}] is nested; extras are flat scalars")
        if isinstance(value, float) and not math.isfinite(value):  # 1e999 parses as inf
            raise WireError(f"metadata extras[{key[:40]!r}] is not finite")
    return extras
