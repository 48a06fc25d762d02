"""Python processes running one test script (argv[1]: the path the script waits on), for the Python tracer's tests:
started with any interpreter, each returned once it has mapped its interpreter, all killed by stop()."""
import os
import subprocess
import sys
import time
from pathlib import Path

from support.batch_rows import stop_all


def wait_mapped(pid, python, timeout=60) -> str:
    """Until the interpreter has mapped its libpython, or itself and libc (exec and dynamic loading done)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            maps = ""
        if "libpython" in maps or (os.path.realpath(python) in maps and "libc" in maps):
            return maps
        assert time.monotonic() < deadline, f"pid {pid} did not map its interpreter"
        time.sleep(0.01)


class ScriptProcesses:
    def __init__(self, script: Path):
        self.script = script
        self.procs: list[subprocess.Popen] = []

    def start(self, go, python=sys.executable, env=None) -> subprocess.Popen:
        p = subprocess.Popen([python, str(self.script), str(go)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONHASHSEED": "0", **(env or {})})
        self.procs.append(p)
        wait_mapped(p.pid, python)
        return p

    def stop(self) -> None:
        stop_all(self.procs)
