"""eBPF tracers (bcc): each turns a probe family in bpf/ into batches.

The agent loads them by name through producers.tracers.manager, lazily, so a
host without bcc still imports this package.
"""
from fleetscope.producers.tracers.kernel import KernelTracer, TracerUnavailable

__all__ = ["KernelTracer", "TracerUnavailable"]
