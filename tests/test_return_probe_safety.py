"""Tracing never changes a program's exception path (issue 13 §1).

A uretprobe replaces the return address; a C++ exception unwinding through
the probed function then makes the process call std::terminate (SIGABRT).
The traced program here is real C++ built with g++: a stand-in
libtorch_cpu.so (tests/support/throwing_lib.cpp) defining functions under
the demangled names the torch tracer probes (gloo's
UnboundBuffer::waitRecv/waitSend, c10d::Work::wait), half of whose calls
throw, and a program (throwing_main.cpp) that catches them. Real eBPF, real
uprobes. The library is a stand-in only because the real gloo waits throw
only on a timeout or a lost peer, which a test cannot cause on cue; the GPU
libraries are the project's C stand-ins (no GPU on the machine).

The declaration checks at the end need no root: every tracer says, per
symbol pattern, why a return probe is safe there, and a link set refuses
any return probe not covered.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from fleetscope.config import Config
from support.batch_rows import rows, values

SUPPORT = Path(__file__).parent / "support"
ROUNDS = 20  # odd rounds throw: ROUNDS/2 successful and ROUNDS/2 failed calls of each wait
EXPECTED_OUTPUT = f"ok={3 * ROUNDS // 2} caught={3 * ROUNDS // 2} ranks={3 * ROUNDS // 2} gpu_rc=0\n"
root = pytest.mark.skipif(os.geteuid() != 0, reason="loading BPF programs needs root (CI runs as root)")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the throwing library")


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    """The built program: a directory with libtorch_cpu.so (the throwing stand-in), prog, and the GPU stubs."""
    from fleetscope.eval.gpu_stub.build import build
    out = tmp_path_factory.mktemp("throwing")
    subprocess.run(["g++", "-O2", "-shared", "-fPIC", "-o", str(out / "libtorch_cpu.so"),
                    str(SUPPORT / "throwing_lib.cpp")], check=True)
    subprocess.run(["g++", "-O2", "-o", str(out / "prog"), str(SUPPORT / "throwing_main.cpp"), f"-L{out}",
                    "-ltorch_cpu", f"-Wl,-rpath,{out}"], check=True)
    build(out / "gpu")
    return out


class Run:
    """One run of the program: started, ready (its libraries mapped), then released with `finish()`."""

    def __init__(self, out: Path):
        self.proc = subprocess.Popen([str(out / "prog"), str(ROUNDS), str(out / "gpu")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        line = self.proc.stdout.readline()
        assert line == "ready\n", f"the program did not start: {line!r} {self.proc.stderr.read() if not line else ''}"

    def finish(self) -> tuple[int, str, str]:
        out, err = self.proc.communicate("go\n", timeout=60)
        return self.proc.returncode, out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@root
@needs_gxx
def test_throwing_gloo_and_c10d_waits_survive_the_torch_tracer(program):
    """The old code put uretprobes on these waits: the first exception killed the program with SIGABRT."""
    from fleetscope.producers.tracers.torch_ops import TorchTracer
    tracer = TorchTracer("node-a")
    run = Run(program)
    try:
        assert tracer.add_pid(run.pid), tracer.unavailable.get(run.pid)
        # no libtorch_python, no nextTag: the waits only
        assert set(tracer.family_unavailable[run.pid]) == {"ops", "collectives"}
        tracer.sample()
        rc, out, err = run.finish()
        got = rows(tracer.sample())
        hits = tracer.hits()["waits"]
    finally:
        run.kill()
        tracer.close()
    assert (rc, out) == (0, EXPECTED_OUTPUT), err
    calls = values(got, "torch.comm_wait_calls", run.pid)
    unpaired = values(got, "torch.comm_wait_unpaired", run.pid)
    # every successful wait was timed at its ret; a thrown one reached no ret and was counted unpaired at
    # the thread's next entry of its kind (the last round's throw has no next entry)
    assert calls == {"recv": ROUNDS // 2, "send": ROUNDS // 2, "work": ROUNDS // 2}
    assert unpaired == {"recv": ROUNDS // 2 - 1, "send": ROUNDS // 2 - 1, "work": ROUNDS // 2 - 1}
    assert all(v > 0 for v in values(got, "torch.comm_wait_ns", run.pid).values())
    assert hits == 3 * ROUNDS + 3 * ROUNDS // 2  # every entry, and one ret per call that returned


@root
@needs_gxx
@pytest.mark.integration
@pytest.mark.slow
def test_every_family_the_agent_loads_leaves_the_program_as_it_was(program):
    """The same program traced by every tracer the agent loads (the manager, as the agent builds it) ends
    with the same status and output as untraced, every family of every tracer attached (the governor would
    duty-cycle the expensive ones: the throwing gloo waits among them); the tracers that can attach to it
    (kernel, cuda, nccl, torch) did."""
    from fleetscope.producers.tracers.manager import TracerManager
    from fleetscope.producers.tracers.registry import TRACERS

    untraced = Run(program)
    try:
        assert untraced.finish()[:2] == (0, EXPECTED_OUTPUT)
    finally:
        untraced.kill()

    run = Run(program)
    cfg = Config(trace=tuple(TRACERS), trace_pids=(str(run.pid),), trace_auto=False)
    manager = TracerManager(cfg, hit_cost_ns=6000.0)
    try:
        manager.poll_targets()
        attached = {name for name, pids in manager.attached.items() if run.pid in pids}
        for tracer in manager.tracers.values():  # the expensive ones too, which the governor would duty-cycle
            for family in getattr(tracer, "families", dict)():
                tracer.set_family_enabled(family, True)
        traced = run.finish()
        hits = {name: t.hits() for name, t in manager.tracers.items() if hasattr(t, "hits")}
    finally:
        run.kill()
        manager.close()
    assert attached >= {"kernel", "cuda", "nccl", "torch"}, (attached, manager.unavailable)
    assert hits["torch"]["waits"] > 0 and hits["cuda"]["sync"] > 0 and hits["nccl"]["collectives"] > 0
    assert traced[:2] == (0, EXPECTED_OUTPUT), traced[2]


# ---- the declarations (no root) ---------------------------------------------------------------------

def test_every_tracer_declares_why_each_of_its_return_probes_is_safe():
    from fleetscope.producers.tracers.registry import TRACERS, tracer_class
    for name in TRACERS:
        declared = tracer_class(name).RETURN_PROBES
        assert isinstance(declared, dict), name
        for pattern, why in declared.items():
            assert pattern and isinstance(why, str) and len(why) > 40, (name, pattern, why)


def test_the_gpu_tracers_declare_every_api_they_put_a_return_probe_on():
    from fleetscope.producers.tracers.cuda import CudaTracer
    from fleetscope.producers.tracers.nccl import NcclTracer
    from fleetscope.producers.tracers.uprobes import Link, check_return_probes
    for cls in (CudaTracer, NcclTracer):
        symbols = tuple(a.symbol for a in cls.APIS)
        check_return_probes([Link(0, "lib", tuple(range(len(symbols))), (0,) * len(symbols), retprobe=True,
                                  symbols=symbols)], cls.RETURN_PROBES)


def test_the_torch_declaration_covers_its_op_wrappers_and_never_the_throwing_waits():
    """Against the real libtorch_python of the venv: every op wrapper picked is a declared CPython method;
    the collective waits (which throw) match no declared pattern."""
    import re

    import torch

    from fleetscope.producers.tracers.torch_ops import DEFAULT_OPS, TorchTracer, op_symbols
    from fleetscope.producers.tracers.uprobes import Link, UndeclaredReturnProbe, check_return_probes
    lib = str(Path(torch.__file__).parent / "lib" / "libtorch_python.so")
    picked = [(op, name) for _, op, name in op_symbols(lib) if op in DEFAULT_OPS]
    assert {op for op, _ in picked} >= {"linear", "relu", "matmul", "add_", "backward"}
    names = tuple(name for _, name in picked)
    check_return_probes([Link(0, lib, tuple(range(len(names))), (0,) * len(names), retprobe=True,
                              symbols=names)], TorchTracer.RETURN_PROBES)
    waits = ("gloo::transport::tcp::UnboundBuffer::waitRecv(int*, std::chrono::duration<long, "
             "std::ratio<1l, 1000l> >)", "c10d::Work::wait(std::chrono::duration<long, std::ratio<1l, 1000l> >)")
    for wait in waits:
        assert not any(re.fullmatch(p, wait) for p in TorchTracer.RETURN_PROBES)
        with pytest.raises(UndeclaredReturnProbe, match="no return probe is declared safe"):
            check_return_probes([Link(0, "libtorch_cpu.so", (1,), (0,), retprobe=True, symbols=(wait,))],
                                TorchTracer.RETURN_PROBES)


def test_a_link_set_refuses_an_undeclared_or_unnamed_return_probe_before_touching_the_kernel():
    from fleetscope.producers.tracers.uprobes import Link, LinkSet, UndeclaredReturnProbe
    links = LinkSet({r"safe_\w+": "a test declaration of a function that catches everything"})
    with pytest.raises(UndeclaredReturnProbe):
        links.attach(("pid", "family"), [Link(-1, "/nonexistent", (1,), (0,), retprobe=True,
                                              symbols=("throws",))], pid=1)
    with pytest.raises(UndeclaredReturnProbe, match="must name its function"):
        links.attach(("pid", "family"), [Link(-1, "/nonexistent", (1,), (0,), retprobe=True)], pid=1)
    assert ("pid", "family") not in links


def test_return_sites_finds_the_rets_of_a_real_function(program):
    """objdump over the stand-in's three waits: each site found really is a return instruction."""
    from fleetscope.producers.tracers.torch_ops import comm_symbols
    from fleetscope.producers.tracers.uprobes import file_offset
    lib = str(program / "libtorch_cpu.so")
    fns = comm_symbols(lib).waits
    assert sorted(fn.kind for fn in fns) == [0, 1, 2]
    with open(lib, "rb") as f:
        for fn in fns:
            assert fn.rets and all(r > fn.addr for r in fn.rets)
            for r in fn.rets:
                f.seek(file_offset(lib, r))
                code = f.read(2)
                assert code[0] in (0xC3, 0xC2) or (code[0] in (0xF2, 0xF3) and code[1] in (0xC3, 0xC2)), code


def test_return_sites_counts_jumps_that_leave_and_keeps_those_that_stay():
    from fleetscope.producers.tracers.return_sites import parse_objdump
    listing = """
    1000:\tpush   %rbx
    1004:\tje     0x1010
    1006:\tjmp    0x1020
    1010:\trepz ret
    1012:\tjmp    *%rax
    1014:\tjmp    0x5000
    1019:\tret
    101a:\tbnd jmp 0x4000
"""
    sites = parse_objdump(listing, 0x1000, 0x30)
    assert sites.rets == (0x1010, 0x1019)
    assert sites.jumps_out == 3  # the indirect jump and the jumps to 0x5000 and 0x4000; not the in-range one
