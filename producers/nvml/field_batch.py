"""Many scalar readings of one device in one nvmlDeviceGetFieldValues call.

A FieldBatch owns a preallocated array of nvmlFieldValue_t (the ids written
once): a tick is one C call, then one struct unpack over the array's memory
gives each field's value type, return code and value. NVML answers per field
(each entry has its own nvmlReturn), so one unsupported field costs that
field only.

A field NVML cannot give through field values (an older driver or GPU, say
NVML_FI_DEV_POWER_INSTANT before it existed) falls back to its classic getter
when it has one; only when that fails too is it unsupported. The sampler
sees both paths as one: `read` fills every spec's slot, and the failures come
back as a return code per spec.

Counters become deltas here: each field keeps its previous raw
value and time, and a delta covers exactly the time since that field's last
successful read (nothing on the first read, after a reset, or if no time
passed).

`sample` (read, then rows) has a fast path for the usual tick, which the
sampler takes on every GPU ten times a second: once a read has shown every
field's value type, one struct unpack reads each entry's type and return
code as one number and its value already typed, a tuple compare checks all
of them at once, and the deltas are computed with C-level map() over the
previous raw values. Anything unusual (a failed field, a changed value type,
a counter that went back, a missing baseline) takes the general path for
that read, from the same filled array, so nothing is read twice.
"""
from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable
from itertools import compress, repeat
from operator import mul, sub
from typing import NamedTuple

import pynvml


class FieldSpec(NamedTuple):
    name: str            # bookkeeping name: unsupported/error reports, status rows "gpu<N>:<name>"
    metric: str
    field_id: int
    scope_id: int = 0
    scale: float = 1.0   # raw -> our unit (for counters, applied to the delta)
    counter: bool = False
    fallback: Callable | None = None  # fallback(DeviceCalls) -> raw value, the classic getter


# nvmlFieldValue_t as pynvml's c_nvmlFieldValue_t lays it out (40 bytes):
# fieldId, scopeId, timestamp, latencyUsec, then valueType, nvmlReturn and the
# 8-byte value union, read here as raw bits.
_ENTRY = struct.Struct("<24xIIQ")
assert _ENTRY.size == ctypes.sizeof(pynvml.c_nvmlFieldValue_t)
_UNSUPPORTED = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
                pynvml.NVML_ERROR_INVALID_ARGUMENT)  # an id this driver does not know
_U64, _I64, _F64 = struct.Struct("<Q"), struct.Struct("<q"), struct.Struct("<d")


def _signed(bits: int):
    def decode(raw: int) -> float:
        low = raw & ((1 << bits) - 1)
        return float(low - (1 << bits) if low >= 1 << (bits - 1) else low)
    return decode


# nvmlValueType -> the union's raw bits as a number.
_DECODERS = {
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: float,
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: float,  # 64-bit on Linux
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: lambda raw: float(raw & 0xFFFFFFFF),
    pynvml.NVML_VALUE_TYPE_DOUBLE: lambda raw: _F64.unpack(_U64.pack(raw))[0],
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: _signed(64),
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: _signed(32),
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: lambda raw: float(raw & 0xFFFF),
}


# nvmlValueType -> struct code for the union's 8 bytes (little-endian: the
# narrower types sit in the low bytes), for the fast path's typed unpack.
_TYPED = {
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "Q",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "Q",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "I4x",
    pynvml.NVML_VALUE_TYPE_DOUBLE: "d",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "q",
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: "i4x",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "H6x",
}
assert set(_TYPED) == set(_DECODERS)


def _decode(vtype: int, raw: int) -> float:
    """The union's bits as a number, per nvmlValueType."""
    decoder = _DECODERS.get(vtype)
    if decoder is None:
        raise ValueError(f"unknown NVML value type {vtype}")
    return decoder(raw)


class FieldBatch:
    def __init__(self, specs, entry):
        try:
            self._fn = entry("nvmlDeviceGetFieldValues")
        except pynvml.NVMLError:  # a driver without field values: every field takes its getter, or none
            self._fn = None
        self._by_getter: set[str] = set()  # spec names read through their fallback getter
        self._build(tuple(specs), {})

    def _build(self, specs: tuple[FieldSpec, ...], prev: dict) -> None:
        self.specs = specs
        self._batched = [i for i, s in enumerate(specs) if s.name not in self._by_getter]
        self._getters = [i for i, s in enumerate(specs) if s.name in self._by_getter]
        n = len(self._batched)
        self._arr = (pynvml.c_nvmlFieldValue_t * max(n, 1))()
        for j, i in enumerate(self._batched):
            self._arr[j].fieldId, self._arr[j].scopeId = specs[i].field_id, specs[i].scope_id
        self._ref, self._count = ctypes.byref(self._arr), ctypes.c_int32(n)
        # One struct over the whole array: a read is one C-level unpack of the
        # array's own memory (no copy out through ctypes.string_at, no
        # per-entry iterator), giving (value type, return code, raw) per entry.
        self._unpack = struct.Struct("<" + _ENTRY.format.lstrip("<") * n).unpack_from
        # (metric, scale, counter) per spec, and each counter's previous (raw value, ns) or None.
        self._plan = [(s.metric, s.scale, s.counter) for s in specs]
        self._prev = [prev.get(s.metric) for s in specs]
        # The fast path (see `sample`): metrics, scales and 0/1 counter flags per spec; the typed
        # unpack and the (value type | return code << 32) it expects per entry, once a read has
        # shown the types; and, while every counter's baseline is from the same read, those raw
        # values (0 for gauges) and that read's time in _base/_since, which then stand for _prev.
        self.metrics = tuple(s.metric for s in specs)
        self._scales = tuple(s.scale for s in specs)
        self._flags = tuple(1 if s.counter else 0 for s in specs)
        self._typed, self._keys = None, None
        self._base: list | None = None
        self._since: int | None = None
        self._settle()

    def __len__(self) -> int:
        return len(self.specs)

    def drop(self, names: set[str]) -> None:
        """Stop asking for these specs (unsupported on this device); counter baselines carry over."""
        self._unsettle()
        prev = {s.metric: p for s, p in zip(self.specs, self._prev) if p is not None}
        self._build(tuple(s for s in self.specs if s.name not in names), prev)

    def sample(self, calls, now_ns: int) -> tuple[tuple | list, list, list, list | tuple]:
        """read() then rows(): (metrics, values, interval_ns, nvmlReturn per spec,
        or () when every field answered). Raises as read() does."""
        since = self._since
        if since is None or self._typed is None or now_ns <= since:
            ret = self._call(calls)
        else:
            ret = self._fn(calls.handle, self._count, self._ref)
            if not ret:
                flat = self._typed(self._arr)
                if flat[0::2] == self._keys:  # every field answered, with the type seen before
                    raw = flat[1::2]
                    diffs = list(map(sub, raw, self._base))
                    flags = self._flags
                    if min(compress(diffs, flags), default=0) >= 0:  # no counter went back
                        self._base, self._since = list(map(mul, raw, flags)), now_ns
                        return (self.metrics, list(map(mul, diffs, self._scales)),
                                list(map(mul, flags, repeat(now_ns - since))), ())
        values, rets = self._decode(calls, ret)
        metrics, out, intervals = self.rows(values, rets, now_ns)
        return metrics, out, intervals, rets if any(rets) else ()

    def read(self, calls) -> tuple[list[float], list[int]]:
        """(raw values, nvmlReturn per spec). Raises NVMLError only when the
        whole call fails with something other than "unsupported"."""
        return self._decode(calls, self._call(calls))

    def _call(self, calls) -> int:
        """The field-values call's nvmlReturn (0 with nothing to ask it)."""
        if not self._batched:
            return 0
        return self._fn(calls.handle, self._count, self._ref) if self._fn else pynvml.NVML_ERROR_FUNCTION_NOT_FOUND

    def _decode(self, calls, ret: int) -> tuple[list[float], list[int]]:
        """read()'s result once the call returned `ret` (and filled the array)."""
        n = len(self.specs)
        values, rets = [0.0] * n, [0] * n
        if self._batched:
            if ret in _UNSUPPORTED:  # no field values at all here: each field fails alike
                for i in self._batched:
                    rets[i] = ret
            elif ret:
                raise pynvml.NVMLError(ret)
            else:
                flat = self._unpack(self._arr)
                codes = flat[1::3]
                if not self._getters and not any(codes):
                    # The usual read: every field is in the array and answered.
                    try:
                        values = [_DECODERS[vtype](raw) for vtype, raw in zip(flat[0::3], flat[2::3])]
                    except KeyError:
                        pass  # a value type we do not know: the loop below says which
                    else:
                        self._learn(flat[0::3])
                        return values, list(codes)
                for i, vtype, code, raw in zip(self._batched, flat[0::3], codes, flat[2::3]):
                    if code:
                        rets[i] = code
                    else:
                        values[i] = _decode(vtype, raw)
        for i in self._getters:
            values[i], rets[i] = self._by_fallback(self.specs[i], calls)
        if any(rets):
            self._retry_by_getter(calls, values, rets)
        return values, rets

    def _retry_by_getter(self, calls, values, rets) -> None:
        """A batched field NVML could not give: its getter, from now on, if it has one."""
        moved = False
        for i in self._batched:
            spec = self.specs[i]
            if rets[i] in _UNSUPPORTED and spec.fallback is not None:
                self._by_getter.add(spec.name)
                values[i], rets[i] = self._by_fallback(spec, calls)
                moved = True
        if moved:
            self.drop(set())  # rebuild: those fields leave the C array

    @staticmethod
    def _by_fallback(spec: FieldSpec, calls) -> tuple[float, int]:
        try:
            return float(spec.fallback(calls)), 0
        except pynvml.NVMLError as exc:
            return 0.0, exc.value

    def _learn(self, vtypes: tuple) -> None:
        """The fast path's typed unpack, for the value types this read showed."""
        if vtypes == self._keys or self._getters:
            return
        self._typed = struct.Struct("<" + "".join("24xQ" + _TYPED[t] for t in vtypes)).unpack_from
        self._keys = tuple(vtypes)  # with return code 0, an entry's key is its value type

    def _unsettle(self) -> None:
        """Bring _prev up to date after fast reads (they advance only _base and _since)."""
        if self._since is not None:
            self._prev = [(raw, self._since) if counter else None for raw, counter in zip(self._base, self._flags)]

    def _settle(self) -> None:
        """Let the fast path take over when every counter's baseline is from one read."""
        stamps = {p[1] if p is not None else None for p, counter in zip(self._prev, self._flags) if counter}
        if None in stamps or len(stamps) > 1:
            self._base = self._since = None
            return
        self._since = stamps.pop() if stamps else 0
        self._base = [p[0] if counter else 0 for p, counter in zip(self._prev, self._flags)]

    def rows(self, values: list[float], rets: list[int], now_ns: int) -> tuple[list, list, list]:
        """(metrics, values, interval_ns) for this read: gauges that answered and
        counters with a delta. A counter's baseline advances when its read answered.

        Plain Python on purpose: a device has ~10 fields, where numpy's fixed
        cost per call is larger than the whole loop.
        """
        self._unsettle()
        metrics, out, intervals = [], [], []
        prev_all = self._prev
        for i, (metric, scale, counter) in enumerate(self._plan):
            if rets[i]:
                continue
            value = values[i]
            if not counter:
                metrics.append(metric)
                out.append(value * scale)
                intervals.append(0)
                continue
            prev = prev_all[i]
            prev_all[i] = (value, now_ns)
            # First read, a counter that went backwards (driver reload, reset), or no time passed: no delta.
            if prev is not None and value >= prev[0] and now_ns > prev[1]:
                metrics.append(metric)
                out.append((value - prev[0]) * scale)
                intervals.append(now_ns - prev[1])
        self._settle()
        return metrics, out, intervals
