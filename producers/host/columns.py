"""Batch columns that repeat from tick to tick, built once and reused; batch ids.

A sampler emits nearly the same rows every tick: the same metrics on the
same devices in the same order, only the values differ. Dictionary-encoding
the metric and device names (a dict, a dict lookup per row, a numpy array)
and filling the node-identity columns was a large part of a tick's CPU. So
these are built once per layout and handed out again while the layout
repeats; comparing a tick's name list with a kept one is one C-level pass
over pointers (the names are mostly the same string objects every tick).

The reused arrays are shared by every batch of that layout, so they are made
read-only: a consumer that tried to write into one would fail loudly rather
than change other batches. (Nothing downstream writes into a batch's
columns; the publisher and the stream worker index and copy them.)

Both samplers use this module (the host's and NVML's): it lives here because
the producers package has no shared module of its own.
"""
from __future__ import annotations

import itertools
import os
from collections.abc import Sequence

import numpy as np

from fleetscope.schema import node_identity
from fleetscope.wire import StrColumn

# Layouts kept per column: the every-tick layout, the one with the once-a-second
# groups, and a couple of rarer ones (10 s groups, a tick with status rows).
_KEPT_LAYOUTS = 4


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def str_column(items: Sequence[str]) -> StrColumn:
    """Dictionary in first-seen order (np.unique would sort it), then one C-level dict lookup per row."""
    values = tuple(dict.fromkeys(items))
    index = {s: i for i, s in enumerate(values)}
    codes = np.fromiter(map(index.__getitem__, items), dtype=np.uint32, count=len(items))
    return StrColumn(codes, values)


class RepeatingColumn:
    """One column (say, "metric") of successive batches: `build(items)` once per
    distinct sequence of items, the result reused while that sequence comes back.
    `build` may also return a tuple of columns (NVML builds its metric, device and
    gpu columns from one row layout); each is made read-only."""

    def __init__(self, build=str_column) -> None:
        self._build = build
        self._recent: list[tuple[tuple, StrColumn | np.ndarray]] = []  # most recently used first

    def __call__(self, items: Sequence) -> StrColumn | np.ndarray:
        items = tuple(items)  # a tuple as it is; a list copied, since the caller may reuse it
        recent = self._recent
        for k, (seen, column) in enumerate(recent):
            if seen == items:  # a length check first, then mostly pointer-equal items
                if k:
                    recent.insert(0, recent.pop(k))
                return column
        column = self._build(items)
        for col in column if isinstance(column, tuple) else (column,):
            _read_only(col.codes if isinstance(col, StrColumn) else col)
        recent.insert(0, (items, column))
        del recent[_KEPT_LAYOUTS:]
        return column


class NodeIdentityColumns:
    """fleetscope.schema.node_identity(host, n), kept per row count n.

    Node-level rows all carry the same identity, so for a given n the five
    columns never change."""

    def __init__(self, host: str) -> None:
        self.host = host
        self._by_count: dict[int, dict] = {}

    def __call__(self, n: int) -> dict:
        columns = self._by_count.get(n)
        if columns is None:
            columns = node_identity(self.host, n)
            for column in columns.values():
                _read_only(column.codes if isinstance(column, StrColumn) else column)
            if len(self._by_count) >= _KEPT_LAYOUTS:
                self._by_count.pop(next(iter(self._by_count)))  # the oldest
            self._by_count[n] = columns
        return dict(columns)  # the caller adds its own columns to the dict


class BatchIds:
    """Unique batch ids, as cheap as a counter: a random 64-bit prefix per
    sampler, then a 64-bit count (32 hex digits, like uuid4().hex).

    Batch's default, uuid4(), cost about 0.1 ms of CPU per tick (os.urandom
    and the UUID object) at a 100 ms tick on a cold cache: a tenth of the
    sampler's budget. Consumers only need ids to be unique (they deduplicate
    by them), which a fresh random prefix per sampler instance keeps across
    samplers, processes and restarts."""

    def __init__(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._count = itertools.count()

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._count):016x}"
