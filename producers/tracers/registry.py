"""The tracers the agent can load: one line each. Adding a tracer is its module plus one line here.

Each tracer is named after the source it publishes (`cfg.trace` lists these
names). From this table come the classes the manager loads and the options
each one gets from the configuration. The core keeps its own copy of the
names (it may not import producers): fleetscope.schema.TRACED_SOURCES lists
the sources whose rows carry sample_frac, and fleetscope.config.TRACE_FAMILIES
is "kernel" plus those. tests/test_tracer_registry.py checks that both agree
with this table, and that every option names a real Config field and a real
constructor keyword.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from fleetscope.producers.tracers.kernel import TracerUnavailable


@dataclass(frozen=True)
class TracerEntry:
    module: str                  # under fleetscope.producers.tracers
    cls: str
    sample_frac: bool            # its rows say what fraction of the interval its probes were attached
    options: dict[str, str] = field(default_factory=dict)  # constructor keyword -> Config field


_DETAIL = {"detail": "trace_capture_s", "detail_always": "trace_capture_anomalies"}
TRACERS: dict[str, TracerEntry] = {
    "kernel": TracerEntry("kernel", "KernelTracer", sample_frac=False),  # tracepoints, never duty-cycled
    # detail mode (per-call records) while the agent captures (trace_capture_s > 0 is true); its gate open for the
    # whole run with trace_capture_anomalies, else opened by live capture requests (producers/trace_capture.py)
    "cuda": TracerEntry("cuda", "CudaTracer", sample_frac=True, options=_DETAIL),
    "nccl": TracerEntry("nccl", "NcclTracer", sample_frac=True, options=_DETAIL),
    "python": TracerEntry("python_vm", "PythonTracer", sample_frac=True,
                          options={"prefixes": "trace_python_prefixes", **_DETAIL}),
    "torch": TracerEntry("torch_ops", "TorchTracer", sample_frac=True, options=_DETAIL),
    # sampled stacks through py-spy: any CPython 3.9-3.14, USDT or not
    "python_sampler": TracerEntry("python_sampler", "PythonSampler", sample_frac=True,
                                  options={"prefixes": "trace_python_prefixes"}),
}
TRACED_SOURCES = tuple(name for name, entry in TRACERS.items() if entry.sample_frac)


def tracer_class(name: str) -> type:
    entry = TRACERS[name]
    try:
        module = importlib.import_module(f"fleetscope.producers.tracers.{entry.module}")
    except ImportError as e:
        raise TracerUnavailable(f"the {name} tracer is not available in this build ({e})") from e
    return getattr(module, entry.cls)


def tracer_options(name: str, cfg) -> dict:
    """The constructor keywords tracer `name` takes from the configuration."""
    return {kw: getattr(cfg, cfg_field) for kw, cfg_field in TRACERS[name].options.items()}


def load_tracer(name: str, cfg, resolver=None):
    """A running tracer `name` for the configured host; TracerUnavailable says why it cannot run here."""
    return tracer_class(name)(cfg.host, resolver=resolver, **tracer_options(name, cfg))
