"""Build the GPU stand-ins (see README.md) with gcc, and run the known workload."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIBS = {"libcudart.so.12": "cudart_stub.c", "libcuda.so.1": "cuda_driver_stub.c", "libnccl.so.2": "nccl_stub.c"}


def build(out: Path) -> Path:
    """Compile the three stand-in libraries and the workload into `out`; returns `out`."""
    if shutil.which("gcc") is None:
        raise RuntimeError("gcc is needed to build the GPU stand-ins in src/fleetscope/eval/gpu_stub; install gcc")
    out.mkdir(parents=True, exist_ok=True)
    for lib, src in LIBS.items():
        subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(out / lib), str(HERE / src), "-ldl", "-lpthread"], check=True)
    subprocess.run(["gcc", "-O2", "-o", str(out / "workload"), str(HERE / "workload.c"), "-ldl"], check=True)
    return out


class Workload:
    """The workload process: `loaded()` waits for its dlopen, `go()` releases a "go"-mode run.

    With late_load the process starts without the libraries and dlopens them only when
    `load()` tells it to, so a test can look at it before and after, whatever the load."""

    def __init__(self, bindir: Path, mode: str, iters: int, rate_hz: int = 0, late_load: bool = False,
                 wait_for_go: bool = True, env: dict | None = None):
        args = [str(bindir / "workload"), mode, str(bindir), str(iters), str(rate_hz), "wait" if late_load else "0"]
        if wait_for_go:
            args.append("go")
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        self.pid = self.proc.pid
        if late_load:
            line = self.proc.stdout.readline()
            assert line.strip() == "started", f"workload did not start: {line!r}"

    def load(self) -> None:
        """A late_load workload: dlopen the libraries now (then wait for them with `loaded()`)."""
        self.proc.stdin.write("load\n")
        self.proc.stdin.flush()

    def loaded(self) -> None:
        line = self.proc.stdout.readline()
        assert line.strip() == "loaded", f"workload did not load its libraries: {line!r}"

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = 60) -> tuple[int, float, float]:
        """Wait for the end: (iterations done, wall ns per iteration, the thread's CPU ns per iteration)."""
        line = self.proc.stdout.readline().split()
        self.proc.wait(timeout)
        assert line and line[0] == "done", f"workload ended without its summary: {line}"
        return int(line[1]), float(line[2]), float(line[3])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
