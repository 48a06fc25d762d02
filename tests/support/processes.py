"""Real processes for identity and sampler tests: started with a given environment, reaped at teardown."""
import os
import subprocess
import sys
import time
import uuid

import pytest

SLEEPER = [sys.executable, "-c", "import time; time.sleep(30)"]


def wait_until(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not reached in time")


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().decode(errors="replace").split("\0")
    except OSError:
        return []


@pytest.fixture
def spawn():
    """Start real processes; every one is killed and reaped at teardown."""
    procs: list[subprocess.Popen] = []

    def start(env: dict[str, str], argv: list[str] = SLEEPER, **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(argv, env=env, **kwargs)
        procs.append(proc)
        # Until the child execs, /proc shows the forked copy of pytest (its environ too).
        wait_until(lambda: _cmdline(proc.pid)[:len(argv)] == list(argv) or proc.poll() is not None)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


# wakes every 20 ms, so a new affinity moves it at once (a sleeping task keeps its old CPU until it runs)
NAP = "import time\nend = time.time() + 60\nwhile time.time() < end: time.sleep(0.02)"


def last_cpu(pid: int) -> int:
    from fleetscope.producers.process_sampler import parse_stat, read_file
    return parse_stat(read_file(f"/proc/{pid}/stat"))[6]


def pinned_ranks(spawn, cpus: list[int], job_prefix: str = "pinned") -> dict[int, tuple[int, int]]:
    """One napping "rank" per entry of `cpus` (RANK, WORLD_SIZE = len(cpus), one job), each pinned to its CPU
    and seen there: {rank: (pid, cpu)}."""
    job = f"{job_prefix}-{uuid.uuid4().hex[:8]}"
    ranks = {}
    for rank, cpu in enumerate(cpus):
        env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")},
               "RANK": str(rank), "WORLD_SIZE": str(len(cpus)), "FLEETSCOPE_JOB": job}
        child = spawn(env, [sys.executable, "-c", NAP])
        os.sched_setaffinity(child.pid, {cpu})
        wait_until(lambda: last_cpu(child.pid) == cpu)
        ranks[rank] = (child.pid, cpu)
    return ranks
