"""Incidents: flagged windows grouped per (tenant, job, culprit host, culprit rank), not one alert per window.

A window flagged on the anomalies topic or diagnosed on the diagnoses topic opens or extends its incident
(both topics carry the same window, so they count once). An incident that saw no new window for `resolve_s`
of wall time resolves. What each change needs sent is a Notification; the book sends nothing itself.

Bounded, so a fleet-wide event cannot flood receivers or memory:
- a job with `max_rank_incidents` rank incidents open folds any further rank into one job-wide incident
  (host "*", rank -1, role "job_wide"): an SRE wants one alert for "many ranks of this job", not hundreds;
- at most `max_open` incidents are open at once; a window that would open one more is counted in
  `over_limit` (and the service logs it), never silently.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

WAITING = "waiting"  # a rank that waits on a culprit is not an incident of its own
JOB_WIDE = "job_wide"  # the role of the incident that a job's ranks fold into past max_rank_incidents
MAX_WINDOWS_KEPT = 4096  # distinct window starts remembered per incident, for counting each window once
MAX_RANK_INCIDENTS_PER_JOB = 16
MAX_OPEN_INCIDENTS = 10_000


@dataclass(frozen=True)
class IncidentKey:
    tenant: str
    job: str
    host: str
    rank: int


@dataclass
class Incident:
    key: IncidentKey
    role: str
    first_window_ns: int
    last_window_ns: int
    max_score: float
    threshold: float
    window_starts: set[int] = field(default_factory=set)  # for counting each window once; bounded
    window_count: int = 0  # distinct windows counted (a restored incident keeps only its newest starts)
    kb_entries: dict[str, float] = field(default_factory=dict)  # entry -> best confidence
    last_seen: float = 0.0           # monotonic time of the newest window's arrival
    resolved_at_ns: int | None = None

    @property
    def windows(self) -> int:
        return self.window_count

    @property
    def firing(self) -> bool:
        return self.resolved_at_ns is None


@dataclass(frozen=True)
class Notification:
    kind: str  # "open" | "update" | "resend" | "resolve"
    incident: Incident


class RecordError(ValueError):
    """A message on an alert topic lacks what an incident needs; the text says which field."""


class IncidentBook:
    def __init__(self, resolve_s: float, resend_s: float, clock=time.monotonic, wall_ns=time.time_ns,
                 max_rank_incidents: int = MAX_RANK_INCIDENTS_PER_JOB, max_open: int = MAX_OPEN_INCIDENTS):
        self.resolve_s = resolve_s
        self.resend_s = resend_s
        self.max_rank_incidents = max_rank_incidents
        self.max_open = max_open
        self.over_limit = 0  # windows that would have opened an incident past max_open
        self._ranks_open: dict[tuple[str, str], int] = {}  # open rank incidents per (tenant, job)
        self.clock = clock
        self.wall_ns = wall_ns
        self.open: dict[IncidentKey, Incident] = {}
        self.sent_at: dict[IncidentKey, float] = {}
        self.pending: list[Notification] = []
        self.skipped_waiting = 0
        self.changes = 0  # bumped by every change to the open incidents, so a saver knows when to write

    def restore(self, inc: Incident, quiet_for_s: float) -> None:
        """Adopt an incident a previous process delivered and saved, silent for `quiet_for_s` already.

        Its open was delivered, so none is sent again; a resend is due at once, so Alertmanager hears it
        still fires (the same labels: the same alert) even if the restart outlasted its resolve timeout.
        """
        now = self.clock()
        inc.last_seen = now - max(0.0, quiet_for_s)
        self._opened(inc)
        self.sent_at[inc.key] = now - self.resend_s
        self.changes += 1

    def last_seen_wall_ns(self, inc: Incident) -> int:
        """When the incident's newest window arrived, on the wall clock (monotonic time ends with the process)."""
        return self.wall_ns() - int((self.clock() - inc.last_seen) * 1e9)

    def observe(self, record: dict, kb_matches: list[dict] | None = None) -> None:
        """One anomaly (or diagnosis) message, decoded; `kb_matches` are a diagnosis's matches."""
        try:
            key = IncidentKey(str(record["tenant"]), str(record["job"]), str(record["host"]), int(record["rank"]))
            start, score = int(record["window_start_ns"]), float(record["score"])
            threshold = float(record.get("threshold", float("nan")))
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordError(f"alert record lacks or mistypes {exc}: needs tenant, job, host, rank, "
                              f"window_start_ns, score") from None
        role = str(record.get("role") or "culprit")
        if role == WAITING:
            self.skipped_waiting += 1
            return
        now = self.clock()
        inc = self.open.get(key)
        if inc is None and self._rank_incidents(key) >= self.max_rank_incidents:
            key, role = IncidentKey(key.tenant, key.job, "*", -1), JOB_WIDE
            inc = self.open.get(key)
        if inc is None and len(self.open) >= self.max_open:
            self.over_limit += 1
            return
        if inc is None:
            inc = Incident(key, role, start, start, score, threshold, last_seen=now)
            self._opened(inc)
            self.pending.append(Notification("open", inc))
        new_window = start not in inc.window_starts
        if new_window and len(inc.window_starts) < MAX_WINDOWS_KEPT:
            inc.window_starts.add(start)
            inc.window_count += 1
        if new_window:
            inc.last_seen = now
            self.changes += 1
        inc.first_window_ns, inc.last_window_ns = min(inc.first_window_ns, start), max(inc.last_window_ns, start)
        inc.max_score = max(inc.max_score, score)
        changed = False
        for m in kb_matches or ():
            entry, conf = str(m.get("kb_entry", "")), float(m.get("confidence", 0.0))
            if entry and conf > inc.kb_entries.get(entry, -1.0):
                changed = changed or entry not in inc.kb_entries
                inc.kb_entries[entry] = conf
        if changed:
            self.changes += 1
            if not any(n.incident is inc for n in self.pending):
                self.pending.append(Notification("update", inc))

    def _rank_incidents(self, key: IncidentKey) -> int:
        return self._ranks_open.get((key.tenant, key.job), 0)

    def _opened(self, inc: Incident) -> None:
        self.open[inc.key] = inc
        if inc.key.rank >= 0:
            job = (inc.key.tenant, inc.key.job)
            self._ranks_open[job] = self._ranks_open.get(job, 0) + 1

    def _closed(self, key: IncidentKey) -> None:
        del self.open[key]
        job = (key.tenant, key.job)
        if key.rank >= 0 and job in self._ranks_open:
            self._ranks_open[job] -= 1
            if not self._ranks_open[job]:
                del self._ranks_open[job]

    def due(self) -> list[Notification]:
        """Everything to send now: opens and updates observed, resends of firing alerts, resolves."""
        now = self.clock()
        out, self.pending = self.pending, []
        for key, inc in list(self.open.items()):
            if now - inc.last_seen >= self.resolve_s:
                inc.resolved_at_ns = self.wall_ns()
                self._closed(key)
                self.sent_at.pop(key, None)
                self.changes += 1
                out = [n for n in out if n.incident is not inc] + [Notification("resolve", inc)]
            elif key in self.sent_at and now - self.sent_at[key] >= self.resend_s \
                    and not any(n.incident is inc for n in out):
                out.append(Notification("resend", inc))
        return out

    def mark_sent(self, notes: list[Notification]) -> None:
        now = self.clock()
        for n in notes:
            if n.incident.firing:
                self.sent_at[n.incident.key] = now
