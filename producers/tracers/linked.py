"""What the uprobe_multi-link tracers (Python, torch) share: probe families switched by links.

A subclass sets FAMILIES ({name: "expensive" | "always"}), `source`, and in its
constructor `host`, `resolver`, `pids` ({pid: ...}), `enabled` ({family: bool}),
`links` (a LinkSet keyed (pid, family)) and `_clock` (a DutyClock); it
implements `_attach(pid, family)`, and `_family_detached(family)` when
detaching leaves state behind (call stacks whose returns will go unseen).
"""
from __future__ import annotations

import logging

from fleetscope.producers.tracers.rows import RowIdentity, identity

log = logging.getLogger(__name__)


class LinkedFamilyTracer:
    FAMILIES: dict[str, str] = {}
    source = ""

    def _identity(self, pid: int) :
        return identity(self.resolver, self.host, pid)

    def families(self) -> dict[str, str]:
        return dict(self.FAMILIES)

    def remove_pid(self, pid: int) -> None:
        self._detach_pid(int(pid))
        self.pids.pop(int(pid), None)

    def _detach_pid(self, pid: int) -> None:
        self.links.detach([(pid, family) for family in self.FAMILIES])

    def set_family_enabled(self, family: str, on: bool) -> None:
        if family not in self.FAMILIES:
            raise KeyError(f"unknown family {family!r}; known: {sorted(self.FAMILIES)}")
        if self.enabled[family] == on:
            return
        self.enabled[family] = on
        if not on:
            self._clock.set(family, False)
            self.links.detach([(pid, family) for pid in self.pids])  # all processes: one grace period
            self._family_detached(family)
            return
        for pid in list(self.pids):
            try:
                self._attach(pid, family)
            except OSError as e:  # the process exited between polls
                log.debug("%s tracer: pid %d family %s: %s", self.source, pid, family, e)
        self._clock.set(family, True)

    def _attach(self, pid: int, family: str) -> None:
        raise NotImplementedError

    def _family_detached(self, family: str) -> None:
        """Called after a family's links are gone from every process."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
