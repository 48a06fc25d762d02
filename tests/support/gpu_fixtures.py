"""pytest fixtures shared by the CUDA and NCCL tracer tests; a test module imports
them and defines `tracer_cls` (the tracer under test)."""
from __future__ import annotations

import pytest

from fleetscope.eval.gpu_stub.build import Workload, build


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    return build(tmp_path_factory.mktemp("gpu_stub"))


@pytest.fixture
def make(stubs, tracer_cls):
    """(make_tracer(**kw), make_workload(mode, iters, ...)); everything made is closed or killed after the test."""
    made, procs = [], []

    def tracer(**kw):
        t = tracer_cls("node-a", **kw)
        made.append(t)
        return t

    def workload(*args, **kw):
        w = Workload(stubs, *args, **kw)
        procs.append(w)
        return w

    try:
        yield tracer, workload
    finally:
        for w in procs:
            w.kill()
        for t in made:
            t.close()
