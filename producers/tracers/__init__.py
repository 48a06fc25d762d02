"""eBPF tracers (bcc): each turns a probe family in bpf/ into batches."""
from producers.tracers.kernel import KernelTracer, TracerUnavailable

__all__ = ["KernelTracer", "TracerUnavailable"]
