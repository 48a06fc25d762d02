"""Direct NVML calls for the per-tick readings, with preallocated out-parameters.

pynvml's wrappers allocate a ctypes struct, look the entry point up under a
lock and wrap the result on every call: about 4 us each, against about 1.3 us
for the C call itself through ctypes. On 8 GPUs at 10 ticks a second that
difference alone was a third of the sampler's budget. So the calls made on
every tick resolve their entry points once (through pynvml, after nvmlInit, so
they are the library pynvml loaded) and reuse one out-parameter per device.
Errors are pynvml's own exception classes (`pynvml.NVMLError(code)` picks the
subclass), so callers handle them exactly as for pynvml's wrappers.

The out-parameters are read back with one struct unpack of their memory:
pynvml's structures override __getattribute__ (for printing), which makes
each field read cost about as much as the C call itself.

The process list and per-process utilization (once a second) are also
direct: pynvml asks for the count first, then builds an object per process
through __getattribute__, which on a cold cache made the once-a-second tick
cost about twice a fast one. Here each device keeps a buffer, one call fills
it (a second only when more processes than ever before hold the GPU) and one
struct pass reads it. Rarer calls (GPM support, handles) stay on pynvml.
"""
from __future__ import annotations

import ctypes
import struct

import pynvml

# The layouts of pynvml's c_nvmlUtilization_t (gpu, memory) and c_nvmlMemory_t (total, free, used).
_UTILIZATION = struct.Struct("<II")
_MEMORY = struct.Struct("<QQQ")
assert _UTILIZATION.size == ctypes.sizeof(pynvml.c_nvmlUtilization_t)
assert _MEMORY.size == ctypes.sizeof(pynvml.c_nvmlMemory_t)
# c_nvmlProcessInfo_v3_t as (pid, usedGpuMemory); c_nvmlProcessUtilizationSample_t as (pid, timeStamp, smUtil, memUtil).
_PROCESS = struct.Struct("<I4xQ8x")
_PROCESS_UTIL = struct.Struct("<I4xQII8x")
assert _PROCESS.size == ctypes.sizeof(pynvml.c_nvmlProcessInfo_v3_t)
assert pynvml.c_nvmlProcessInfo_v3_t.usedGpuMemory.offset == 8
assert _PROCESS_UTIL.size == ctypes.sizeof(pynvml.c_nvmlProcessUtilizationSample_t)
assert (pynvml.c_nvmlProcessUtilizationSample_t.timeStamp.offset, pynvml.c_nvmlProcessUtilizationSample_t.smUtil.offset,
        pynvml.c_nvmlProcessUtilizationSample_t.memUtil.offset) == (8, 16, 20)
_NO_MEMORY = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value  # the driver cannot attribute memory (WDDM)

_NAMES = ("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetClockInfo",
          "nvmlDeviceGetMaxClockInfo", "nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage",
          "nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetPcieReplayCounter",
          "nvmlDeviceGetPcieThroughput", "nvmlDeviceGetFieldValues", "nvmlDeviceGetComputeRunningProcesses_v3",
          "nvmlDeviceGetProcessUtilization")


class EntryPoints:
    """The C entry points, resolved once after nvmlInit. A missing one raises
    NVMLError_FunctionNotFound when first used, as pynvml's wrapper would."""

    def __init__(self):
        self._fns: dict[str, object] = {}
        for name in _NAMES:
            try:
                self._fns[name] = pynvml._nvmlGetFunctionPointer(name)
            except pynvml.NVMLError:
                pass  # an old driver without it: the first call says so

    def __call__(self, name: str):
        fn = self._fns.get(name)
        if fn is None:
            fn = self._fns[name] = pynvml._nvmlGetFunctionPointer(name)  # raises FunctionNotFound
        return fn

    def throttle(self):
        """The clock-event reasons entry point, under its current name or the older one."""
        for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            try:
                return self(name)
            except pynvml.NVMLError_FunctionNotFound:
                continue
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)


class DeviceCalls:
    """One device's per-tick calls. Each returns plain numbers or raises NVMLError."""

    LIST_START = 16  # entries in a new process-list buffer; it grows on demand

    def __init__(self, handle, entry: EntryPoints):
        self.handle = handle
        self._entry = entry
        self._util = pynvml.c_nvmlUtilization_t()
        self._mem = pynvml.c_nvmlMemory_t()
        self._uint = ctypes.c_uint()
        self._ull = ctypes.c_ulonglong()
        self._util_ref, self._mem_ref = ctypes.byref(self._util), ctypes.byref(self._mem)
        self._uint_ref, self._ull_ref = ctypes.byref(self._uint), ctypes.byref(self._ull)
        self._fn_util = entry("nvmlDeviceGetUtilizationRates")
        self._fn_mem = entry("nvmlDeviceGetMemoryInfo")
        self._fn_clock = entry("nvmlDeviceGetClockInfo")
        self._fn_throttle = None
        self._lists = {}  # entry point name -> [buffer, its capacity in entries]
        self._count = ctypes.c_uint()
        self._count_ref = ctypes.byref(self._count)

    def utilization(self) -> tuple[int, int]:
        ret = self._fn_util(self.handle, self._util_ref)
        if ret:
            raise pynvml.NVMLError(ret)
        return _UTILIZATION.unpack_from(self._util)

    def memory(self) -> tuple[int, int]:
        """(used, total) bytes."""
        ret = self._fn_mem(self.handle, self._mem_ref)
        if ret:
            raise pynvml.NVMLError(ret)
        total, _, used = _MEMORY.unpack_from(self._mem)
        return used, total

    def clock(self, kind: int) -> int:
        ret = self._fn_clock(self.handle, kind, self._uint_ref)
        if ret:
            raise pynvml.NVMLError(ret)
        return self._uint.value

    def throttle(self) -> int:
        if self._fn_throttle is None:
            self._fn_throttle = self._entry.throttle()
        ret = self._fn_throttle(self.handle, self._ull_ref)
        if ret:
            raise pynvml.NVMLError(ret)
        return self._ull.value

    def tick(self) -> tuple[int, int, int, int, int, int] | None:
        """utilization(), memory() used, clock(SM), clock(MEM) and throttle() in
        one call: (gpu util, memory util, memory used, SM clock, memory clock,
        clock-event mask), or None as soon as one of them fails.

        The sampler makes these five calls on every GPU every tick; one Python
        call for all of them saves the frames of five. On None the sampler
        repeats them one by one, which tells which failed and why."""
        handle, clock, uint_ref = self.handle, self._fn_clock, self._uint_ref
        if self._fn_util(handle, self._util_ref) or self._fn_mem(handle, self._mem_ref):
            return None
        if clock(handle, pynvml.NVML_CLOCK_SM, uint_ref):
            return None
        sm_clock = self._uint.value
        if clock(handle, pynvml.NVML_CLOCK_MEM, uint_ref):
            return None
        mem_clock = self._uint.value
        if self._fn_throttle is None:
            try:
                self._fn_throttle = self._entry.throttle()
            except pynvml.NVMLError:
                return None
        if self._fn_throttle(handle, self._ull_ref):
            return None
        gpu_util, mem_util = _UTILIZATION.unpack_from(self._util)
        _, _, mem_used = _MEMORY.unpack_from(self._mem)
        return gpu_util, mem_util, mem_used, sm_clock, mem_clock, self._ull.value

    def uint(self, name: str, *args) -> int:
        """Any `nvmlReturn fn(device, args..., unsigned *out)` call."""
        ret = self._entry(name)(self.handle, *args, self._uint_ref)
        if ret:
            raise pynvml.NVMLError(ret)
        return self._uint.value

    def ull(self, name: str, *args) -> int:
        """Any `nvmlReturn fn(device, args..., unsigned long long *out)` call."""
        ret = self._entry(name)(self.handle, *args, self._ull_ref)
        if ret:
            raise pynvml.NVMLError(ret)
        return self._ull.value

    def processes(self) -> list[tuple[int, int | None]]:
        """(pid, used GPU memory in bytes, or None where the driver cannot attribute it) per compute process."""
        n, buf = self._list("nvmlDeviceGetComputeRunningProcesses_v3", pynvml.c_nvmlProcessInfo_v3_t)
        return [(pid, None if mem == _NO_MEMORY else mem)
                for pid, mem in _PROCESS.iter_unpack(ctypes.string_at(buf, n * _PROCESS.size))]

    def process_utilization(self, last_seen_us: int) -> list[tuple[int, int, int, int]]:
        """(pid, timeStamp in us, SM util %, memory util %) per sample newer than last_seen_us; [] when NVML holds none."""
        try:
            n, buf = self._list("nvmlDeviceGetProcessUtilization", pynvml.c_nvmlProcessUtilizationSample_t,
                                ctypes.c_ulonglong(last_seen_us))
        except pynvml.NVMLError_NotFound:
            return []  # NVML's way of saying it holds no samples newer than last_seen_us
        return list(_PROCESS_UTIL.iter_unpack(ctypes.string_at(buf, n * _PROCESS_UTIL.size)))

    def _list(self, name: str, entry_type, *args) -> tuple[int, object]:
        """NVML's (device, buffer, *count[, args]) list calls, into a buffer kept per call.

        The buffer grows when NVML says INSUFFICIENT_SIZE (and how many it
        needs); processes can start between the two calls, so it asks a few times.
        (The process list takes (device, *count, buffer); utilization takes
        (device, buffer, *count, ...); `args` tells them apart.)"""
        kept = self._lists.get(name)
        if kept is None:
            kept = self._lists[name] = [(entry_type * self.LIST_START)(), self.LIST_START]
        fn = self._entry(name)
        for _ in range(4):
            buf, capacity = kept
            self._count.value = capacity
            if args:
                ret = fn(self.handle, buf, self._count_ref, *args)
            else:
                ret = fn(self.handle, self._count_ref, buf)
            if ret != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
                break
            capacity = max(self._count.value * 2 + 5, capacity * 2)
            kept[:] = [(entry_type * capacity)(), capacity]
        if ret:
            raise pynvml.NVMLError(ret)
        return min(self._count.value, kept[1]), kept[0]
