"""A batch of events as producers build it and workers read it: named columns
of equal length, numeric numpy arrays or dictionary-encoded strings.

The wire format that carries a batch through Kafka is in wire.py; this module
holds only the in-memory shape, so every producer and stream shares it.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import numpy as np

# The wire format's version: 1 was fleetscope's own columnar layout (retired,
# never deployed); 2 is one Arrow IPC stream per message.
SCHEMA_VERSION = 2

# Kafka header names; the same facts are inside the payload, and decode
# checks that the two agree.
H_SCHEMA, H_SOURCE, H_HOST, H_BATCH, H_COUNT = (
    "fs-schema", "fs-source", "fs-host", "fs-batch", "fs-count")


class WireError(ValueError):
    """A message that is not a valid batch. The message says exactly why, in one line."""


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
    extras: dict = field(default_factory=dict)  # flat: str -> number, str, bool or None (e.g. sampling_fraction)

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
