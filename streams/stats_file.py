"""A worker's counters as a small JSON file in its data dir, rewritten every second.

The worker serves no store endpoint (the sink owns the store), yet `fleetscope up`'s
status line, the tests and the benchmarks need its counters (events in, windows out,
DLQ, model stats). A file per worker process, `<data_dir>/workers/<pid>.json`, is the
simplest thing that works for any number of workers sharing a data dir: no port, no
token, and a reader that knows the pid reads exactly that worker. Each write is a
rename, so a reader never sees half a file; a clean stop removes it.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)
STATS_DIR = "workers"


def worker_stats_path(data_dir: Path, pid: int) -> Path:
    return Path(data_dir) / STATS_DIR / f"{pid}.json"


def read_worker_stats(data_dir: Path, pid: int) -> dict | None:
    """The counters worker `pid` wrote last, or None before its first write (or after it stopped)."""
    try:
        doc = json.loads(worker_stats_path(data_dir, pid).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


class StatsFile:
    """Writes `provider()` to the worker's stats file every `interval_s` on a thread of its own."""

    def __init__(self, data_dir: Path, provider: Callable[[], dict], interval_s: float = 1.0):
        self.path = worker_stats_path(data_dir, os.getpid())
        self.provider = provider
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleetscope-stats-file", daemon=True)

    def start(self) -> "StatsFile":
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.write()  # at once: its presence tells a launcher the worker is up
        self._thread.start()
        return self

    def write(self) -> None:
        try:
            doc = {**self.provider(), "pid": os.getpid(), "written_at_ns": time.time_ns()}
        except Exception:  # a snapshot taken mid-update: keep the last file, try again next tick
            log.debug("worker snapshot unavailable; stats file not rewritten this time", exc_info=True)
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, self.path)
        except OSError as exc:  # a full disk must not stop the worker: its data path does not need this file
            log.warning("cannot write the worker stats file %s: %s", self.path, exc)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.write()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self.path.unlink(missing_ok=True)
