"""How long each probe family of a duty-cycled tracer was attached during each
sample interval: the rows' sample_frac."""
from __future__ import annotations

import time


class DutyClock:
    """How long each family was attached during each sample interval."""

    def __init__(self, families, on: bool = True):
        now = time.monotonic_ns()
        self.on_since: dict[str, int | None] = {f: (now if on else None) for f in families}
        self.on_ns = dict.fromkeys(families, 0)
        self.last = now  # start of the current interval

    def set(self, family: str, on: bool) -> None:
        now = time.monotonic_ns()
        since = self.on_since[family]
        if on and since is None:
            self.on_since[family] = now
        elif not on and since is not None:
            self.on_ns[family] += now - since
            self.on_since[family] = None

    def fractions(self) -> dict[str, float]:
        """Fraction of the interval since the previous call each family was on; starts the next interval.
        A family on throughout gets exactly 1.0 (same clock for both ends)."""
        now = time.monotonic_ns()
        span, self.last = now - self.last, now
        out = {}
        for fam, since in self.on_since.items():
            on = self.on_ns[fam] + (now - since if since is not None else 0)
            out[fam] = min(on / span, 1.0) if span > 0 else (1.0 if since is not None else 0.0)
            self.on_ns[fam] = 0
            if since is not None:
                self.on_since[fam] = now
        return out
