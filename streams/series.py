"""Numbering of metric series, so window aggregates can live in numpy arrays.

A series is (source, metric, device). Strings are interned once per worker
(a batch's string dictionary is resolved once per distinct dictionary, not per
batch); each stream key numbers its own series densely in order of first
sight, so a window's aggregates are arrays indexed by that number and a batch
folds in with np.bincount instead of a Python loop per series. The numbers of
all keys live in one sorted index, so a batch of many ranks is numbered with
one searchsorted.
"""
from __future__ import annotations

import numpy as np

_BITS = 21  # ids per field: 2M distinct metric names / devices per worker
# caches (bounded in entries and in each entry's size): producers repeat a few dictionaries and layouts
_DICT_CACHE = 4096  # distinct string dictionaries remembered
_DICT_CACHED_VALUES = 512  # larger dictionaries are resolved every time
_LAYOUT_CACHE = 16384  # distinct batch layouts (keys, rows per key, series) remembered
_LAYOUT_CACHED_ROWS = 512  # larger batches are numbered every time


class Interner:
    """string <-> small int, for the life of the worker."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.names: list[str] = []
        self._dicts: dict[tuple, np.ndarray] = {}  # string dictionary (or source, dictionary) -> ids (bits)

    def id(self, name: str) -> int:
        i = self.ids.get(name)
        if i is None:
            i = self.ids[name] = len(self.names)
            if i >= 1 << _BITS:
                raise OverflowError(f"more than {1 << _BITS} distinct names")
            self.names.append(name)
        return i

    def metric_bits(self, source: str, metrics: tuple[str, ...]) -> np.ndarray:
        """series_code's source and metric bits for each value of a metric dictionary (cached like ids_of)."""
        cached = len(metrics) <= _DICT_CACHED_VALUES
        bits = self._dicts.get((source, metrics)) if cached else None
        if bits is None:
            bits = series_code(self.id(source), self.ids_of(metrics), np.int64(0))
            if cached:
                if len(self._dicts) >= _DICT_CACHE:
                    self._dicts.clear()
                self._dicts[(source, metrics)] = bits
        return bits

    def ids_of(self, values: tuple[str, ...]) -> np.ndarray:
        """The ids of a batch's string dictionary (one lookup per distinct dictionary, not per batch)."""
        ids = self._dicts.get(values) if len(values) <= _DICT_CACHED_VALUES else None
        if ids is None:
            ids = np.fromiter((self.id(v) for v in values), dtype=np.int64, count=len(values))
            if len(values) <= _DICT_CACHED_VALUES:
                if len(self._dicts) >= _DICT_CACHE:
                    self._dicts.clear()
                self._dicts[values] = ids
        return ids


def series_code(source_id: int, metric_ids: np.ndarray, device_ids: np.ndarray) -> np.ndarray:
    return (np.int64(source_id) << (2 * _BITS)) | (metric_ids << _BITS) | device_ids


def split_code(code: int) -> tuple[int, int, int]:
    mask = (1 << _BITS) - 1
    return code >> (2 * _BITS), (code >> _BITS) & mask, code & mask


class _SortedIds:
    """int64 -> dense int, as a sorted array (vectorized lookups; inserts are rare)."""

    def __init__(self) -> None:
        self.keys = np.empty(0, dtype=np.int64)
        self.vals = np.empty(0, dtype=np.int64)

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions, known mask)."""
        pos = np.searchsorted(self.keys, keys)
        if not len(self.keys):
            return pos, np.zeros(len(keys), dtype=bool)
        return pos, self.keys[np.minimum(pos, len(self.keys) - 1)] == keys

    def insert(self, new_keys: np.ndarray, new_vals: np.ndarray) -> None:
        """Add keys not present yet (any order)."""
        order = np.argsort(new_keys, kind="stable")
        new_keys, new_vals = new_keys[order], new_vals[order]
        at = np.searchsorted(self.keys, new_keys)
        self.keys, self.vals = np.insert(self.keys, at, new_keys), np.insert(self.vals, at, new_vals)


class SeriesNumbers:
    """Each stream key's series, numbered 0..n-1 in order of first sight.

    Keys are small ints (`new_key`). Within one batch, a key's new series are
    numbered in (group, series code) order, groups being the batch's
    (tenant, job, rank, window) groups in sorted order.
    """

    def __init__(self) -> None:
        self._sid = _SortedIds()  # series code -> worker-wide series id
        self._local = _SortedIds()  # key << _BITS | series id -> the key's number for it
        self.counts: list[int] = []  # series per key
        self._layouts: dict[tuple, np.ndarray] = {}

    def new_key(self) -> int:
        self.counts.append(0)
        return len(self.counts) - 1

    def _sids(self, codes: np.ndarray) -> np.ndarray:
        pos, known = self._sid.find(codes)
        if not known.all():
            new = np.unique(codes[~known])
            start = len(self._sid.keys)
            if start + len(new) > 1 << _BITS:
                raise OverflowError(f"more than {1 << _BITS} distinct series")
            self._sid.insert(new, np.arange(start, start + len(new), dtype=np.int64))
            pos, known = self._sid.find(codes)
        return self._sid.vals[pos]

    def local(self, key_ids: list[int], counts: list[int], codes: np.ndarray) -> np.ndarray:
        """The keys' numbers for these rows' series, numbering the new ones. The rows come as runs of
        `counts` rows, one run per (key, window) group of key_ids[i], in sorted group order. A node
        sends the same layout every tick, so answers are remembered by layout (numbers never change)."""
        if len(codes) > _LAYOUT_CACHED_ROWS:  # a large batch: the lookup is a small part of its cost
            return self._number(np.repeat(np.array(key_ids, dtype=np.int64), counts), counts, codes)
        layout = (tuple(key_ids), tuple(counts), codes.tobytes())
        found = self._layouts.get(layout)
        if found is None:
            found = self._number(np.repeat(np.array(key_ids, dtype=np.int64), counts), counts, codes)
            found.flags.writeable = False
            if len(self._layouts) >= _LAYOUT_CACHE:
                self._layouts.clear()
            self._layouts[layout] = found
        return found

    def _number(self, key_ids: np.ndarray, counts: list[int], codes: np.ndarray) -> np.ndarray:
        pairs = (key_ids << _BITS) | self._sids(codes)
        pos, known = self._local.find(pairs)
        if known.all():
            return self._local.vals[pos]
        new = np.flatnonzero(~known)
        group = np.repeat(np.arange(len(counts)), counts)[new]
        order = new[np.lexsort((codes[new], group))]
        _, first = np.unique(pairs[order], return_index=True)
        fresh = pairs[order[np.sort(first)]]  # in order of first sight
        numbers = np.empty(len(fresh), dtype=np.int64)
        tally = self.counts
        for i, key in enumerate((fresh >> _BITS).tolist()):
            numbers[i] = tally[key]
            tally[key] += 1
        self._local.insert(fresh, numbers)
        pos, _ = self._local.find(pairs)
        return self._local.vals[pos]
