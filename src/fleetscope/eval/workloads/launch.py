"""Start a workload as N local ranks through torchrun, and find the rank processes.

torchrun (`python -m torch.distributed.run`) works offline with a c10d rendezvous on
loopback. It gives every rank RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
TORCHELASTIC_RUN_ID, which is what the agent's identity resolver reads from /proc.

`python` picks the interpreter. For USDT probes use Debian's /usr/bin/python3.11 with
`site_packages` set to the venv's site-packages (it goes on PYTHONPATH); torchrun starts
the ranks with the same interpreter.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

DDP_TRAIN = Path(__file__).resolve().parent / "ddp_train.py"
DEBIAN_PYTHON = "/usr/bin/python3.11"


def venv_site_packages() -> str:
    """The site-packages of the interpreter running this code (the project venv).

    Found without importing torch: a process that maps libtorch is a tracing target
    (trace_auto), and the evaluation runner must not trace itself."""
    import sysconfig
    return sysconfig.get_paths()["purelib"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tasks:
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except FileNotFoundError:
            pass
    return out


def environ_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


@dataclass
class Launch:
    proc: subprocess.Popen
    nprocs: int
    run_id: str
    log_path: Path
    result_dir: Path
    _ranks: dict[int, int] = field(default_factory=dict)

    def rank_pids(self, timeout_s: float = 30.0) -> dict[int, int]:
        """rank -> pid of the rank process, found under torchrun by its RANK variable."""
        deadline = time.monotonic() + timeout_s
        while len(self._ranks) < self.nprocs:
            if self.proc.poll() is not None:
                raise RuntimeError(f"torchrun exited with {self.proc.returncode} before all ranks started:\n"
                                   f"{self.log_path.read_text()[-3000:]}")
            stack = children(self.proc.pid)
            while stack:
                pid = stack.pop()
                env = environ_of(pid)
                if env.get("TORCHELASTIC_RUN_ID") == self.run_id and "RANK" in env and "LOCAL_RANK" in env:
                    self._ranks[int(env["RANK"])] = pid
                else:
                    stack += children(pid)
            if len(self._ranks) >= self.nprocs:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"found ranks {sorted(self._ranks)} of {self.nprocs} after {timeout_s} s")
            time.sleep(0.1)
        return dict(self._ranks)

    def wait(self, timeout_s: float) -> list[dict]:
        """Wait for the end; return each rank's JSON result, sorted by rank."""
        try:
            out, _ = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise TimeoutError(f"workload still running after {timeout_s} s; stopped it. Log:\n"
                               f"{self.log_path.read_text()[-3000:]}") from None
        files = sorted(self.result_dir.glob("rank*.json"))
        results = [json.loads(f.read_text()) for f in files]
        shutil.rmtree(self.result_dir, ignore_errors=True)
        if self.proc.returncode != 0 or len(results) != self.nprocs:
            raise RuntimeError(f"workload exited with {self.proc.returncode} and {len(results)} of {self.nprocs} "
                               f"rank results in {self.result_dir}. Stdout:\n{out[-2000:]}\n"
                               f"Log:\n{self.log_path.read_text()[-3000:]}")
        return sorted(results, key=lambda r: r["rank"])

    def stop(self) -> None:
        """Stop torchrun and its ranks (they share its process group)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass


def launch(nprocs: int, args: list[str], *, script: Path = DDP_TRAIN, python: str | None = None,
           site_packages: str | None = None, env: dict[str, str] | None = None,
           run_id: str | None = None, log_path: Path | None = None) -> Launch:
    """Start `script args` as `nprocs` ranks under torchrun; each rank leaves its JSON result in result_dir."""
    if not 1 <= nprocs <= 8:
        raise ValueError(f"nprocs must be 1..8 on one machine, got {nprocs}")
    python = python or sys.executable
    run_id = run_id or f"fleetscope-{uuid.uuid4().hex[:8]}"
    full_env = {**os.environ, **(env or {})}
    if site_packages:
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (site_packages, full_env.get("PYTHONPATH")) if p)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    log_path = log_path or Path(f"/tmp/{run_id}.log")
    result_dir = Path(tempfile.mkdtemp(prefix=f"{run_id}-results-"))
    full_env["FLEETSCOPE_WORKLOAD_RESULT_DIR"] = str(result_dir)
    cmd = [python, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nprocs}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={run_id}",
           "--max-restarts=0", str(script), *args]
    log = open(log_path, "ab")
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=log, text=True,
                            start_new_session=True)
    log.close()
    return Launch(proc=proc, nprocs=nprocs, run_id=run_id, log_path=log_path, result_dir=result_dir)
