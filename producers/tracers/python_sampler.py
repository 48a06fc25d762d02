"""PythonSampler: sampled Python stacks of any CPython 3.9-3.14, with or without USDT.

The USDT tracer (python_vm.py) needs an interpreter built with dtrace probes
(Debian's is; conda, uv, pyenv and python.org builds are not), and counting
every call traps each one (a call-heavy loop ran 13x slower). This source
reads stacks from the interpreter's memory instead, a few dozen times a
second, through py-spy (PyPI `py-spy`, a static binary that knows each
CPython version's frame layout) run by the agent:

    py-spy record --pid P --rate R --nonblocking --format raw --duration W

per traced process, one window of W seconds after another. --nonblocking
reads the target's memory with process_vm_readv without stopping it, so the
traced process pays nothing per sample (benchmarks/python_sampler_cost_bench.py
measures it); a stack read while the interpreter changes it can be wrong now
and then, which a share over hundreds of samples absorbs.

Rows (source "python_sampler"), per pid, when a window ends:
- python.samples, device "all": stacks sampled in the window (idle threads,
  those waiting in a syscall, are not sampled; interval_ns = the window);
- python.sample_share, device "module:function": share of the window's
  samples with the function anywhere on the stack (inclusive, each function
  counted once per sample), top `top_n`;
- python.sample_self_share: share of samples with the function as the
  innermost frame (its own time), top `top_n`.
- python.stack_top, device "module:function": the innermost frame of the
  main thread's stack when the window ended, idle or not (one `py-spy dump
  --nonblocking --json` per pid and window, ~10 ms), and also, alone, when
  a rank of a job of several goes idle between window ends (idle_watch.py): where the rank is
  blocked, for telling a hung job's stuck rank from the ranks waiting in the
  collective (streams/stack_signature.py). Idle threads are exactly what the
  shares above leave out, and a rank waiting in a collective is idle.
GC time is not visible this way (a collection runs in C under whatever
Python frame allocated); the USDT tracer's gc probes give it where they exist.

A process is sampled if its executable or a mapped library is a CPython
(python3.X / libpython3.X). `prefixes` keeps only frames whose file starts
with one of them (the configured trace_python_prefixes).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from fleetscope.wire import Batch
from fleetscope.producers.tracers.idle_watch import IdleWatch
from fleetscope.producers.tracers.kernel import TracerUnavailable
from fleetscope.producers.tracers.python_vm import module_name
from fleetscope.producers.tracers.rows import RowIdentity, identity, metric_batch

log = logging.getLogger(__name__)

PYTHON = re.compile(r"/(?:lib)?python3\.\d+[^/]*$|/python3?$")
FRAME = re.compile(r"^(?P<func>.*) \((?P<file>.*?)(?::\d+)?\)$")  # "mid (/srv/train.py:7)"


@dataclass
class Window:
    proc: subprocess.Popen
    out: Path
    started_ns: int

    @property
    def err(self) -> Path:
        """py-spy's stderr, in a file beside its output: a pipe's read end once read back None (EAGAIN) in a
        loaded CI run and so raised inside the agent's tick; a file read after the process ended cannot."""
        return err_path(self.out)


def err_path(out: Path) -> Path:
    return out.with_suffix(".err")


def py_spy_error(stderr: str) -> str:
    """py-spy's own error line ("Error: ..."), not the stack backtrace it may print after it; else its last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    return next((ln for ln in lines if ln.startswith("Error:")), lines[-1] if lines else "")


def _read_and_remove(path: Path) -> str:
    """A finished window's file as text ("" when py-spy wrote none), then gone."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
    finally:
        path.unlink(missing_ok=True)


def find_py_spy() -> str:
    """The py-spy binary: on PATH, or next to this interpreter (a virtualenv's bin/)."""
    found = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if not found:
        raise TracerUnavailable("the python_sampler source needs py-spy, which is not installed; "
                                "run `pip install py-spy==0.4.3` in the agent's environment")
    return found


def is_python(pid: int) -> bool:
    """Whether the process runs a CPython interpreter (its executable, or libpython mapped)."""
    try:
        if PYTHON.search(os.readlink(f"/proc/{pid}/exe")):
            return True
        with open(f"/proc/{pid}/maps") as f:
            return any("libpython3" in line for line in f)
    except OSError:
        return False


def parse_raw(text: str, prefixes: tuple[str, ...] = ()) -> tuple[int, Counter, Counter]:
    """(samples, inclusive counts, self counts) per "module:function" from py-spy's raw (collapsed) output."""
    samples, inclusive, own = 0, Counter(), Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        samples += n
        names = []
        for frame in stack.split(";"):
            m = FRAME.match(frame)
            if m is None or (prefixes and not m["file"].startswith(prefixes)):
                continue
            names.append(f"{module_name(m['file'])}:{m['func']}")
        for name in set(names):
            inclusive[name] += n
        if names:
            own[names[-1]] += n
    return samples, inclusive, own


DUMP_TIMEOUT_S = 5.0  # all of a tick's stack dumps together


def top_of_dump(text: str, pid: int, prefixes: tuple[str, ...]) -> str | None:
    """The innermost "module:function" of the main thread in `py-spy dump --json` output (the thread whose id
    is the pid, else the first), past the configured prefixes; None if there is none or the text is not JSON."""
    try:
        threads = json.loads(text)
    except ValueError:
        return None
    main = [t for t in threads if t.get("os_thread_id") == pid] or threads[:1]
    for frame in (main[0].get("frames") or []) if main else []:   # innermost first
        file = frame.get("filename") or ""
        if not prefixes or file.startswith(prefixes):
            return f"{module_name(file)}:{frame.get('name')}"
    return None


class PythonSampler:
    SOURCE = "python_sampler"
    FAMILIES = {"stacks": "always"}  # no probe hits: the traced process is never stopped
    RETURN_PROBES: dict[str, str] = {}  # it places no probes at all: py-spy reads the process's memory

    def __init__(self, host: str, resolver=None, rate_hz: int = 49, window_s: int = 5, top_n: int = 20,
                 prefixes: tuple[str, ...] = ()):
        if not 1 <= rate_hz <= 1000 or window_s < 1:
            raise ValueError(f"rate_hz={rate_hz}, window_s={window_s}: need 1 <= rate_hz <= 1000 and window_s >= 1")
        self.py_spy = find_py_spy()
        self.host, self.resolver = host, resolver
        self.rate_hz, self.window_s, self.top_n, self.prefixes = int(rate_hz), int(window_s), top_n, tuple(prefixes)
        self.windows: dict[int, Window] = {}
        self.unavailable: dict[int, str] = {}  # pid -> why py-spy could not sample it
        self._dir = Path(tempfile.mkdtemp(prefix="fleetscope-pysample-"))
        self._on = True
        self._finished: list[tuple] = []  # rows of windows that ended since the last sample()
        self.idle_watch = IdleWatch()
        self.idle_dumps = 0   # stacks read as a process went idle, between its windows' own dumps

    # -- targets ---------------------------------------------------------------
    def add_pid(self, pid: int) -> bool:
        pid = int(pid)
        if pid in self.windows:
            return True
        if not is_python(pid):
            return False
        self.unavailable.pop(pid, None)
        self.windows[pid] = self._start(pid) if self._on else None
        return True

    def remove_pid(self, pid: int) -> None:
        window = self.windows.pop(int(pid), None)
        if window is not None:
            self._stop(window)

    @property
    def pids(self) -> set[int]:
        return set(self.windows)

    def _start(self, pid: int) -> Window:
        out = self._dir / f"{pid}-{time.monotonic_ns()}.txt"
        cmd = [self.py_spy, "record", "--pid", str(pid), "--rate", str(self.rate_hz), "--nonblocking",
               "--format", "raw", "--full-filenames", "--duration", str(self.window_s), "-o", str(out)]
        with open(err_path(out), "wb") as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
        return Window(proc, out, time.time_ns())

    @staticmethod
    def _stop(window: Window) -> None:
        if window.proc.poll() is None:
            window.proc.terminate()
            try:
                window.proc.wait(5)
            except subprocess.TimeoutExpired:
                window.proc.kill()
                window.proc.wait(5)
        window.out.unlink(missing_ok=True)
        window.err.unlink(missing_ok=True)

    # -- the governor's controls -------------------------------------------------
    def families(self) -> dict[str, str]:
        return dict(self.FAMILIES)

    def set_family_enabled(self, family: str, on: bool) -> None:
        if family not in self.FAMILIES:
            raise KeyError(f"{self.SOURCE} has no family {family!r}; it has {sorted(self.FAMILIES)}")
        self._on = bool(on)
        for pid, window in list(self.windows.items()):
            if not on and window is not None:
                self._stop(window)
                self.windows[pid] = None
            elif on and window is None:
                self.windows[pid] = self._start(pid)

    # -- sampling -----------------------------------------------------------------
    def sample(self, now_ns: int | None = None) -> Batch | None:
        now_ns = time.time_ns() if now_ns is None else int(now_ns)
        rows: list[tuple] = []
        ended = [(pid, w) for pid, w in list(self.windows.items()) if w is not None and w.proc.poll() is not None]
        # a rank that just went idle mid-window (hung, or blocked on one that is): where it is, now (idle_watch.py)
        sampling = [pid for pid, w in self.windows.items() if w is not None and self._has_peers(pid)]
        idle = set(self.idle_watch.newly_idle(sampling, now_ns)) - {pid for pid, _ in ended}
        tops = self._stack_tops([pid for pid, _ in ended if os.path.exists(f"/proc/{pid}")] + sorted(idle))
        for pid in sorted(idle):
            if pid in tops:
                rows.append(("python.stack_top", tops[pid], 1.0, pid, 0, 1.0))
                self.idle_dumps += 1
        for pid, window in ended:   # the others are off, or still sampling
            rows += self._window_rows(pid, window, now_ns, tops.get(pid))
            if os.path.exists(f"/proc/{pid}") and pid not in self.unavailable:
                self.windows[pid] = self._start(pid)
            else:
                del self.windows[pid]
        if not rows:
            return None
        return metric_batch(self.SOURCE, self.host, rows, now_ns, 0, self._identity)

    def _has_peers(self, pid: int) -> bool:
        """Whether the process is a rank of a job of several, as far as its identity says: only such a rank can
        hang in a collective, and only its stack names a hang's culprit (idle_watch.py). A process that is no
        rank (an inference server between requests, a daemon) or a job's only rank goes idle for nothing to
        name, and was dumped up to three times in each idle spell. Without a resolver, every process is."""
        if self.resolver is None:
            return True
        try:
            ident = self.resolver.resolve(pid)
        except Exception:   # a process that exits mid-resolution: the idle check forgets it anyway
            return False
        # (a gone process resolves to None: no rank) resolvers other than IdentityResolver may not know the size
        return getattr(ident, "rank", -1) >= 0 and getattr(ident, "world_size", -1) != 1

    def _window_rows(self, pid: int, window: Window, now_ns: int, top: str | None) -> list[tuple]:
        err, text = _read_and_remove(window.err), _read_and_remove(window.out)
        if window.proc.returncode != 0 and not text and os.path.exists(f"/proc/{pid}"):
            reason = py_spy_error(err) or f"exit {window.proc.returncode}"
            self.unavailable[pid] = f"py-spy could not sample pid {pid}: {reason}"
            log.warning("python_sampler: %s", self.unavailable[pid])
            return []
        samples, inclusive, own = parse_raw(text, self.prefixes)
        span = max(now_ns - window.started_ns, 0)
        rows = [("python.samples", "all", samples, pid, span, 1.0)]
        if top is not None:
            rows.append(("python.stack_top", top, 1.0, pid, 0, 1.0))
        if samples:
            rows += [("python.sample_share", name, n / samples, pid, 0, 1.0)
                     for name, n in inclusive.most_common(self.top_n)]
            rows += [("python.sample_self_share", name, n / samples, pid, 0, 1.0)
                     for name, n in own.most_common(self.top_n)]
        return rows

    def _stack_tops(self, pids: list[int]) -> dict[int, str]:
        """Each pid's main-thread innermost "module:function" now (idle or not), where py-spy can say. The dumps
        run side by side under one deadline, so the agent's tick waits for the slowest, not for their sum."""
        dumps = {}
        for pid in pids:
            try:
                dumps[pid] = subprocess.Popen([self.py_spy, "dump", "--pid", str(pid), "--nonblocking", "--json",
                                               "--full-filenames"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                              stderr=subprocess.DEVNULL, text=True)
            except OSError:   # no signature this window, as when py-spy cannot read the process
                continue
        deadline = time.monotonic() + DUMP_TIMEOUT_S
        tops = {}
        for pid, proc in dumps.items():
            try:
                out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                continue
            top = top_of_dump(out, pid, self.prefixes) if proc.returncode == 0 else None
            if top is not None:
                tops[pid] = top
        return tops

    def _identity(self, pid: int) :
        return identity(self.resolver, self.host, pid)

    def close(self) -> None:
        for window in self.windows.values():
            if window is not None:
                self._stop(window)
        self.windows.clear()
        shutil.rmtree(getattr(self, "_dir", ""), ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
