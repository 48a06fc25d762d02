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
"""
from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable
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

    def __len__(self) -> int:
        return len(self.specs)

    def drop(self, names: set[str]) -> None:
        """Stop asking for these specs (unsupported on this device); counter baselines carry over."""
        prev = {s.metric: p for s, p in zip(self.specs, self._prev) if p is not None}
        self._build(tuple(s for s in self.specs if s.name not in names), prev)

    def read(self, calls) -> tuple[list[float], list[int]]:
        """(raw values, nvmlReturn per spec). Raises NVMLError only when the
        whole call fails with something other than "unsupported"."""
        n = len(self.specs)
        values, rets = [0.0] * n, [0] * n
        if self._batched:
            ret = self._fn(calls.handle, self._count, self._ref) if self._fn else pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
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
                        return [_DECODERS[vtype](raw) for vtype, raw in zip(flat[0::3], flat[2::3])], list(codes)
                    except KeyError:
                        pass  # a value type we do not know: the loop below says which
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

    def rows(self, values: list[float], rets: list[int], now_ns: int) -> tuple[list, list, list]:
        """(metrics, values, interval_ns) for this read: gauges that answered and
        counters with a delta. A counter's baseline advances when its read answered.

        Plain Python on purpose: a device has ~10 fields, where numpy's fixed
        cost per call is larger than the whole loop.
        """
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
        return metrics, out, intervals
