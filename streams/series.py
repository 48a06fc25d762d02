"""Numbering of metric series, so window aggregates can live in numpy arrays.

A series is (source, metric, device). Strings are interned once per worker;
each stream key numbers its own series densely, so a window's aggregates are
arrays indexed by that number and a batch folds in with np.bincount instead
of a Python loop per series.
"""
from __future__ import annotations

import numpy as np

_BITS = 21  # ids per field: 2M distinct metric names / devices per worker


class Interner:
    """string <-> small int, for the life of the worker."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.names: list[str] = []

    def id(self, name: str) -> int:
        i = self.ids.get(name)
        if i is None:
            i = self.ids[name] = len(self.names)
            if i >= 1 << _BITS:
                raise OverflowError(f"more than {1 << _BITS} distinct names")
            self.names.append(name)
        return i

    def ids_of(self, values: tuple[str, ...]) -> np.ndarray:
        """The ids of a batch's string dictionary (one lookup per distinct value, not per row)."""
        return np.fromiter((self.id(v) for v in values), dtype=np.int64, count=len(values))


def series_code(source_id: int, metric_ids: np.ndarray, device_ids: np.ndarray) -> np.ndarray:
    return (np.int64(source_id) << (2 * _BITS)) | (metric_ids << _BITS) | device_ids


def split_code(code: int) -> tuple[int, int, int]:
    mask = (1 << _BITS) - 1
    return code >> (2 * _BITS), (code >> _BITS) & mask, code & mask


class KeySeries:
    """The series one stream key has sent, numbered 0..n-1 in order of first sight."""

    def __init__(self) -> None:
        self.sorted_codes = np.empty(0, dtype=np.int64)
        self.sorted_local = np.empty(0, dtype=np.int64)
        self.codes: list[int] = []  # local index -> series code
        self.by_metric: dict[tuple[int, int], list[int]] = {}  # (source, metric) -> local indexes

    @property
    def n(self) -> int:
        return len(self.codes)

    def local(self, codes: np.ndarray) -> np.ndarray:
        """Local indexes for series codes, numbering the new ones."""
        pos = np.searchsorted(self.sorted_codes, codes)
        pos_c = np.minimum(pos, max(len(self.sorted_codes) - 1, 0))
        known = (pos < len(self.sorted_codes)) & (self.sorted_codes[pos_c] == codes) if len(self.sorted_codes) \
            else np.zeros(len(codes), dtype=bool)
        if not known.all():
            self._add(np.unique(codes[~known]))
            return self.local(codes)
        return self.sorted_local[pos]

    def _add(self, new_codes: np.ndarray) -> None:
        start = self.n
        for offset, code in enumerate(new_codes.tolist()):
            self.codes.append(code)
            src, metric, _ = split_code(code)
            self.by_metric.setdefault((src, metric), []).append(start + offset)
        codes = np.concatenate([self.sorted_codes, new_codes])
        local = np.concatenate([self.sorted_local, np.arange(start, start + len(new_codes), dtype=np.int64)])
        order = np.argsort(codes, kind="stable")
        self.sorted_codes, self.sorted_local = codes[order], local[order]

    def find(self, code: int) -> int | None:
        pos = int(np.searchsorted(self.sorted_codes, code))
        if pos < len(self.sorted_codes) and self.sorted_codes[pos] == code:
            return int(self.sorted_local[pos])
        return None
