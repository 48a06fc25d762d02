"""The `tracer_factory` fixture: KernelTracers made by a test, each closed (its BPF programs detached) after it."""
from __future__ import annotations

import pytest


@pytest.fixture
def tracer_factory():
    from fleetscope.producers.tracers import KernelTracer
    made = []

    def make(**kw):
        t = KernelTracer("node-a", **kw)
        made.append(t)
        return t

    try:
        yield make
    finally:
        for t in made:
            t.close()
