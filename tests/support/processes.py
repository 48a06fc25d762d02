"""Real processes for identity and sampler tests: started with a given environment, reaped at teardown."""
import subprocess
import sys
import time

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
