"""GPU Performance Monitoring (GPM, Hopper and newer) for one device, and OFU.

GPM metrics are computed between two samples, so a device keeps two sample
buffers and swaps them each tick: the first tick only takes a sample, every
later tick yields the averages over the interval since the previous one.

OFU (overall FLOP utilization), per GPU and tick:

    OFU % = any-tensor-pipe activity % x (SM clock / max SM clock)

It estimates the fraction of the GPU's peak tensor FLOP rate in use: the
tensor pipes were busy that share of the time, at that share of the top clock.
Its limits:
  - tile quantization: a pipe counts as busy for whole tiles, so matrices
    whose shapes do not fill the tiles (and padding, and partial waves) make
    the pipe look busier than the useful FLOPs are; OFU over-counts them;
  - non-tensor work (CUDA-core FP32/FP64 math, elementwise kernels, softmax,
    communication) moves no tensor pipe and counts as zero; the nvml.gpm.fp*
    metrics show it separately;
  - precisions differ in peak rate, and the activity metric does not weight
    them (an FP8 and an FP16 GEMM at the same activity both read the same);
  - the clock is the mean of the SM clocks the sampler read during the
    interval (one per tick), while the activity is NVML's average over it;
    the product of two means is approximate when clock and activity move
    together within the interval.
"""
from __future__ import annotations

import ctypes
import struct

import pynvml

# (metric id, name). Percentages are 0..100, rates MiB/s; all are averages over
# the interval between two GPM samples, so they are published as gauges.
GPM_METRICS = (
    (pynvml.NVML_GPM_METRIC_SM_UTIL, "nvml.gpm.sm_util"),
    (pynvml.NVML_GPM_METRIC_SM_OCCUPANCY, "nvml.gpm.sm_occupancy"),
    (pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL, "nvml.gpm.tensor_util"),
    (pynvml.NVML_GPM_METRIC_HMMA_TENSOR_UTIL, "nvml.gpm.tensor_util.hmma"),
    (pynvml.NVML_GPM_METRIC_IMMA_TENSOR_UTIL, "nvml.gpm.tensor_util.imma"),
    (pynvml.NVML_GPM_METRIC_DMMA_TENSOR_UTIL, "nvml.gpm.tensor_util.dmma"),
    (pynvml.NVML_GPM_METRIC_DFMA_TENSOR_UTIL, "nvml.gpm.tensor_util.dfma"),
    (pynvml.NVML_GPM_METRIC_FP64_UTIL, "nvml.gpm.fp64_util"),
    (pynvml.NVML_GPM_METRIC_FP32_UTIL, "nvml.gpm.fp32_util"),
    (pynvml.NVML_GPM_METRIC_FP16_UTIL, "nvml.gpm.fp16_util"),
    (pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL, "nvml.gpm.dram_bw_util"),
    (pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC, "nvml.gpm.pcie_tx_mibps"),
    (pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC, "nvml.gpm.pcie_rx_mibps"),
    (pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC, "nvml.gpm.nvlink_tx_mibps"),
    (pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC, "nvml.gpm.nvlink_rx_mibps"),
)
TENSOR_METRIC = "nvml.gpm.tensor_util"


def gpm_supported(handle) -> bool:
    return bool(pynvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)


def ofu_percent(tensor_util: float, sm_clock: float, sm_clock_max: float) -> float | None:
    """OFU in percent, or None when the max clock is unknown."""
    if sm_clock_max <= 0:
        return None
    return tensor_util * min(sm_clock / sm_clock_max, 1.0)


# One c_nvmlGpmMetric_t as (nvmlReturn, value): metricId u32, nvmlReturn u32, value f64, then metricInfo.
_METRIC_SIZE = ctypes.sizeof(pynvml.c_nvmlGpmMetric_t)
_METRIC = f"4xId{_METRIC_SIZE - 16}x"
assert (pynvml.c_nvmlGpmMetric_t.nvmlReturn.offset, pynvml.c_nvmlGpmMetric_t.value.offset) == (4, 8)
_METRICS_OFFSET = pynvml.c_nvmlGpmMetricsGet_t.metrics.offset
# pynvml's structures wrap __setattr__ (for strings); the sample handles need none of that.
_set_field = ctypes.Structure.__setattr__


class GpmReader:
    """Two GPM sample buffers for one device; `read` yields metrics between ticks.

    The request struct (19 KB: room for every GPM metric) is built once and
    reused; its results are read with one struct unpack of the same memory,
    and the two C entry points are looked up once.
    """

    def __init__(self, handle):
        self.handle = handle
        self.metrics = list(GPM_METRICS)  # shrinks as metrics prove unsupported
        self._prev = None
        self._cur = None
        self._fn = self._sample_get = None
        self._build()

    def _build(self) -> None:
        request = self._request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(self.metrics)
        for i, (metric_id, _) in enumerate(self.metrics):
            request.metrics[i].metricId = metric_id
        self._unpack = struct.Struct("<" + _METRIC * len(self.metrics)).unpack_from
        self._names = tuple(name for _, name in self.metrics)

    def read(self) -> tuple[list[str], list[float], list[tuple[str, int]]]:
        """(metric names, values, [(metric, nvmlReturn) for each that failed]).

        Raises NVMLError when a sample cannot be taken; the next read starts over.
        """
        if self._prev is None:
            self._prev, self._cur = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
            self._take(self._prev)
            return [], [], []
        self._take(self._cur)
        request = self._request
        _set_field(request, "sample1", self._prev)
        _set_field(request, "sample2", self._cur)
        if self._fn is None:
            self._fn = pynvml._nvmlGetFunctionPointer("nvmlGpmMetricsGet")
        ret = self._fn(ctypes.byref(request))
        self._prev, self._cur = self._cur, self._prev  # this sample starts the next interval
        if ret:
            raise pynvml.NVMLError(ret)
        flat = self._unpack(request, _METRICS_OFFSET)
        rets, values = flat[0::2], flat[1::2]
        if not any(rets):
            return self._names, list(values), []
        names = [n for n, r in zip(self._names, rets) if not r]
        failed = [(n, r) for n, r in zip(self._names, rets) if r]
        return names, [v for v, r in zip(values, rets) if not r], failed

    def drop(self, name: str) -> None:
        self.metrics = [(mid, n) for mid, n in self.metrics if n != name]
        self._build()

    def _take(self, sample) -> None:
        try:
            if self._sample_get is None:
                self._sample_get = pynvml._nvmlGetFunctionPointer("nvmlGpmSampleGet")
            ret = self._sample_get(self.handle, sample)
            if ret:
                raise pynvml.NVMLError(ret)
        except pynvml.NVMLError:
            self.close()  # a half-taken pair would pair samples across a gap
            raise

    def close(self) -> None:
        for sample in (self._prev, self._cur):
            if sample is not None:
                try:
                    pynvml.nvmlGpmSampleFree(sample)
                except pynvml.NVMLError:
                    pass  # freeing after a lost GPU or shutdown can fail; nothing left to release
        self._prev = self._cur = None
