"""Logs a recurring failure once per period, with how often it happened, instead of on every retry.

A store outage used to print a traceback every 0.25 s (each flush retry).
"""
from __future__ import annotations

import logging
import time


class OutageLog:
    def __init__(self, logger: logging.Logger, what: str, period_s: float, clock=time.monotonic):
        self.log = logger
        self.what = what
        self.period_s = period_s
        self.clock = clock
        self.failures = 0  # since the last line
        self.total = 0
        self._last_line: float | None = None
        self.down_since: float | None = None

    def failed(self, exc: BaseException) -> None:
        now = self.clock()
        self.failures += 1
        self.total += 1
        if self.down_since is None:
            self.down_since = now
        if self._last_line is None or now - self._last_line >= self.period_s:
            first = self._last_line is None
            self.log.error("%s: %s (%d failure%s in the last %.0f s; retrying, nothing is acknowledged meanwhile)",
                           self.what, _one_line(exc), self.failures, "" if self.failures == 1 else "s",
                           0.0 if first else now - self._last_line, exc_info=exc if first else None)
            self._last_line = now
            self.failures = 0

    def recovered(self) -> None:
        if self.down_since is None:
            return
        now = self.clock()
        self.log.warning("%s: recovered after %.0f s (%d failures in all)", self.what, now - self.down_since,
                         self.total)
        self.down_since = None
        self._last_line = None
        self.failures = self.total = 0


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
