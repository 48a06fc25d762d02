"""CudaTracer: CUDA runtime (libcudart) and driver (libcuda) calls by uprobes.

Rows (source "cuda"), per pid:
- per API (device = the call: "cudaLaunchKernel", "cudaMemcpyAsync", "cuMemAlloc", ...):
  cuda.calls, cuda.dur_ns, cuda.errors, cuda.bytes (memcpy/memset/malloc/free),
  cuda.lat_p50_ns, cuda.lat_p99_ns (see gpu_calls.py);
- cuda.memcpy_bytes, device "HtoD"/"DtoH"/"DtoD"/"HtoH"/"default" (successful copies);
- cuda.malloc_bytes, cuda.free_bytes (deltas, device memory only; a free's
  size comes from the pointer->size map filled when the allocation returned,
  so memory allocated before tracing began is not counted when freed);
- cuda.mem_live_bytes, cuda.mem_live_allocs (gauges, device "all"): device
  memory allocated since tracing began and not yet freed;
- cuda.pinned_alloc_bytes, cuda.pinned_free_bytes (deltas) and
  cuda.pinned_live_bytes, cuda.pinned_live_allocs (gauges), device "all":
  the same for page-locked host memory (cudaMallocHost, cudaHostAlloc,
  cuMemHostAlloc, cuMemAllocHost), which is host RAM, not GPU memory;
- cuda.nccl_sync_wait_ns, cuda.nccl_syncs (deltas, device "all", once the
  process has made one): the time blocked in, and the number of, sync calls
  (cudaStreamSynchronize, cudaEventSynchronize, cudaDeviceSynchronize,
  cuStreamSynchronize) that were the first on their thread after an NCCL call
  that enqueued work. NCCL calls return once their work is enqueued, so
  nccl.dur_ns is host-side enqueue time; this wait is what the host spent on
  the collective itself (peers included). Paired in BPF through the map the
  NCCL program marks (gpu_calls.py); a sync on another thread than the
  collective's is not paired;
- cuda.launches, device = the kernel's name from the host stub's symbol (at most
  `symbol_cap` names per pid, then "other"); driver launches pass a CUfunction
  handle, not code, and show as "CUfunction@0x...";
- cuda.lost_events.

Families: "launch" (expensive: duty-cycled by the governor), "memory" and "sync" (always on).

Counted once: the runtime enters the driver through its exported symbols
(cudaMalloc -> cuMemAlloc_v2, cudaLaunchKernel -> cuLaunchKernel, ...); a
driver call made inside a runtime call of the same family on the same thread
is skipped in BPF (bpf/cuda.bpf.c), so only the runtime call counts. Driver
calls the application makes itself count as driver calls.
"""
from __future__ import annotations

import re

from fleetscope.producers.tracers.gpu_calls import Api, GpuCallTracer
from fleetscope.producers.tracers.symbols import Symbolizer

MEMCPY_KINDS = {0: "HtoH", 1: "HtoD", 2: "DtoH", 3: "DtoD", 4: "default"}


def _rt(symbol, family, **kw):
    return Api(symbol, family, "cudart", **kw)


def _drv(symbol, family, **kw):
    return Api(symbol, family, "cuda", driver=True, **kw)


class CudaTracer(GpuCallTracer):
    SOURCE = "cuda"
    BPF_FILE = "cuda.bpf.c"
    LIBRARIES = {"cudart": re.compile(r"/libcudart\.so[.\d]*$"), "cuda": re.compile(r"/libcuda\.so[.\d]*$")}
    FAMILIES = {"launch": "expensive", "memory": "always", "sync": "always"}
    RETURN_PROBES = {
        r"cuda\w+": "the CUDA runtime API is C: libcudart reports every failure as a cudaError_t return value "
                    "and lets no C++ exception leave an API call",
        r"cu\w+": "the CUDA driver API is C: libcuda reports every failure as a CUresult return value and lets "
                  "no C++ exception leave an API call",
    }
    APIS = (
        _rt("cudaLaunchKernel", "launch"), _rt("cudaLaunchCooperativeKernel", "launch"),
        _rt("cudaGraphLaunch", "launch"),
        _rt("cudaMemcpy", "memory", has_bytes=True), _rt("cudaMemcpyAsync", "memory", has_bytes=True),
        _rt("cudaMemset", "memory", has_bytes=True),
        _rt("cudaMalloc", "memory", has_bytes=True), _rt("cudaMallocHost", "memory", has_bytes=True),
        _rt("cudaHostAlloc", "memory", has_bytes=True),
        _rt("cudaFree", "memory", has_bytes=True), _rt("cudaFreeHost", "memory", has_bytes=True),
        _rt("cudaStreamSynchronize", "sync"), _rt("cudaDeviceSynchronize", "sync"),
        _rt("cudaEventSynchronize", "sync"),
        _drv("cuLaunchKernel", "launch"), _drv("cuLaunchKernelEx", "launch"),
        _drv("cuMemAlloc_v2", "memory", label="cuMemAlloc", has_bytes=True),
        _drv("cuMemFree_v2", "memory", label="cuMemFree", has_bytes=True),
        _drv("cuMemHostAlloc", "memory", has_bytes=True),
        _drv("cuMemAllocHost_v2", "memory", label="cuMemAllocHost", has_bytes=True),
        _drv("cuMemFreeHost", "memory", has_bytes=True),
        _drv("cuStreamSynchronize", "sync"),
    )
    PID_MAPS = ("stats", "launches", "memcpy_kind", "allocs", "mem", "nccl_sync")
    _HOST_STUB_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchCooperativeKernel")

    def __init__(self, host: str, resolver=None, detail: bool = False, symbol_cap: int = 256,
                 detail_always: bool = True, **kw):
        super().__init__(host, resolver, detail=detail, detail_always=detail_always, **kw)
        self.symbols = Symbolizer(cap=symbol_cap)
        self._prev_mem: dict[int, tuple[int, ...]] = {}
        self._prev_nccl_sync: dict[int, tuple[int, int]] = {}

    def _kernel_name(self, pid: int, api: str, func: int) -> str:
        if api in self._HOST_STUB_LAUNCHES:
            return self.symbols.name(pid, func)
        return f"CUfunction@0x{func:x}"

    def _extra_rows(self, interval, fracs):
        def launch_label(key):
            return self._kernel_name(key[0], self.APIS[key[1]].symbol, key[2]), "launch"

        rows = self._sum_rows(b"launches", "_prev_launches", launch_label, "cuda.launches", interval, fracs)
        rows += self._sum_rows(b"memcpy_kind", "_prev_kinds", lambda k: (MEMCPY_KINDS.get(k[2], f"kind{k[2]}"), "memory"),
                               "cuda.memcpy_bytes", interval, fracs)
        frac = fracs["memory"]
        for k, m in self.bpf[b"mem"].items():
            pid = int(k.value)
            cur = (m.malloc_bytes, m.free_bytes, m.mallocs, m.frees,
                   m.pinned_bytes, m.pinned_free_bytes, m.pinned_allocs, m.pinned_frees)
            prev = self._prev_mem.get(pid, (0,) * len(cur))
            self._prev_mem[pid] = cur
            rows += [("cuda.malloc_bytes", "all", cur[0] - prev[0], pid, interval, frac),
                     ("cuda.free_bytes", "all", cur[1] - prev[1], pid, interval, frac),
                     ("cuda.mem_live_bytes", "all", cur[0] - cur[1], pid, 0, frac),
                     ("cuda.mem_live_allocs", "all", cur[2] - cur[3], pid, 0, frac)]
            if cur[6]:  # pinned rows only for a process that has pinned memory
                rows += [("cuda.pinned_alloc_bytes", "all", cur[4] - prev[4], pid, interval, frac),
                         ("cuda.pinned_free_bytes", "all", cur[5] - prev[5], pid, interval, frac),
                         ("cuda.pinned_live_bytes", "all", cur[4] - cur[5], pid, 0, frac),
                         ("cuda.pinned_live_allocs", "all", cur[6] - cur[7], pid, 0, frac)]
        frac = fracs["sync"]
        for k, s in self.bpf[b"nccl_sync"].items():
            pid, cur = int(k.value), (int(s.wait_ns), int(s.syncs))
            prev = self._prev_nccl_sync.get(pid, (0, 0))
            self._prev_nccl_sync[pid] = cur
            rows += [("cuda.nccl_sync_wait_ns", "all", cur[0] - prev[0], pid, interval, frac),
                     ("cuda.nccl_syncs", "all", cur[1] - prev[1], pid, interval, frac)]
        return rows

    def add_pid(self, pid: int) -> bool:
        ok = super().add_pid(pid)
        if ok:
            self.symbols.prime(int(pid))
        return ok

    def _forget(self, pid: int) -> None:
        self._prev_mem.pop(pid, None)
        self._prev_nccl_sync.pop(pid, None)
        self.symbols.forget(pid)

    def _decode(self, api: Api, pid: int, a: list[int]) -> dict:
        s = api.symbol
        if api.family == "launch" and s != "cudaGraphLaunch":
            rec = {"func": a[0], "grid": (a[1] & 0xFFFFFFFF, a[1] >> 32, a[2] & 0xFFFFFFFF),
                   "block": (a[3] & 0xFFFFFFFF, a[3] >> 32, a[2] >> 32), "shared_mem": a[4], "stream": a[5]}
            if s in self._HOST_STUB_LAUNCHES:
                rec["kernel"] = self.symbols.resolve(pid, a[0])
            return rec
        if s == "cudaGraphLaunch":
            return {"graph": a[0], "stream": a[1]}
        if s.startswith("cudaMemcpy"):
            return {"dst": a[0], "src": a[1], "bytes": a[2], "kind": MEMCPY_KINDS.get(a[3], a[3]),
                    "stream": a[4] if s == "cudaMemcpyAsync" else None}
        if s == "cudaMemset":
            return {"ptr": a[0], "value": a[1] & 0xFFFFFFFF, "bytes": a[2]}
        if api.device in ("cudaMalloc", "cudaMallocHost", "cudaHostAlloc", "cuMemAlloc", "cuMemHostAlloc",
                          "cuMemAllocHost"):
            return {"ptr": a[0], "bytes": a[1]}
        if api.device in ("cudaFree", "cudaFreeHost", "cuMemFree", "cuMemFreeHost"):
            return {"ptr": a[0], "bytes": a[1]}
        return {"handle": a[0]}  # sync: the stream or event (0 for the device)
