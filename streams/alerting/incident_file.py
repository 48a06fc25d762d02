"""The open incidents of `fleetscope alert` on disk, so a restarted process still resolves what it fired.

A versioned JSON document (never pickle: nothing here deserialises code), written whole to a temporary file
created 0600, flushed to disk, then renamed over the old one: a kill leaves the old state or the new one,
never half of one. Bounded: at most MAX_INCIDENTS incidents (the most recently active kept, the rest counted
and logged) with at most MAX_WINDOW_STARTS window starts each. A file that cannot be read (corrupt, another
version, too large) is logged in one line, moved aside as `<name>.bad`, and ignored: the process starts
without saved incidents, as it did before this file existed.
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

from fleetscope.streams.alerting.incidents import Incident, IncidentBook, IncidentKey

log = logging.getLogger(__name__)

VERSION = 1
MAX_INCIDENTS = 2000
MAX_WINDOW_STARTS = 256  # the newest; enough to count a window re-read after a restart once
MAX_FILE_BYTES = 64 * 1024 * 1024  # far above MAX_INCIDENTS full incidents (~6 KB each): anything larger is not ours


class IncidentFileError(ValueError):
    """The file is not a saved incident list this version reads; the text says what is wrong."""


def default_path(data_dir: Path, group: str) -> Path:
    """One file per consumer group: two alert services on different groups must not share incidents."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in group)
    return Path(data_dir) / f"alert-incidents.{safe}.json"


class IncidentFile:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.not_saved = 0  # incidents left out of the last save (over MAX_INCIDENTS)

    # ---- save ---------------------------------------------------------------------------------------------
    def save(self, book: IncidentBook) -> None:
        """Write the book's open incidents; raises OSError if the file could not be written."""
        incidents = sorted(book.open.values(), key=lambda inc: inc.last_seen, reverse=True)
        kept = incidents[:MAX_INCIDENTS]
        if len(incidents) > len(kept):
            if self.not_saved != len(incidents) - len(kept):
                log.warning("alert state %s keeps the %d most recently active incidents; %d older ones are not "
                            "saved and will not be resolved after a restart", self.path, len(kept),
                            len(incidents) - len(kept))
        self.not_saved = len(incidents) - len(kept)
        doc = {"version": VERSION, "saved_at_ns": book.wall_ns(),
               "incidents": [incident_doc(inc, book.last_seen_wall_ns(inc)) for inc in kept]}
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # 0600 from the first byte
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, allow_nan=False, separators=(",", ":"))
                f.flush()
                os.fsync(f.fileno())  # on disk before the rename, and so before the offsets it allows to commit
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a power cut
        finally:
            os.close(dir_fd)

    # ---- load ---------------------------------------------------------------------------------------------
    def load(self, book: IncidentBook) -> int:
        """Restore the saved open incidents into `book`; the number restored (0 without a usable file)."""
        try:
            size = self.path.stat().st_size
            if size > MAX_FILE_BYTES:
                raise IncidentFileError(f"{size} bytes, over the {MAX_FILE_BYTES} this version writes at most")
            incidents = parse(self.path.read_bytes())
        except FileNotFoundError:
            return 0
        except (OSError, IncidentFileError) as exc:
            bad = self.path.with_name(self.path.name + ".bad")
            try:
                os.replace(self.path, bad)  # kept for a look, and out of the way of the next save
                where = f"moved aside as {bad.name}"
            except OSError:
                where = "left in place"
            log.warning("alert state %s ignored (%s), %s: incidents fired before this start will not be resolved "
                        "by this process", self.path, exc, where)
            return 0
        now_ns = book.wall_ns()
        for inc, last_seen_wall_ns in incidents:
            book.restore(inc, quiet_for_s=(now_ns - last_seen_wall_ns) / 1e9)
        return len(incidents)


def incident_doc(inc: Incident, last_seen_wall_ns: int) -> dict:
    k = inc.key
    return {"tenant": k.tenant, "job": k.job, "host": k.host, "rank": k.rank, "role": inc.role,
            "first_window_ns": inc.first_window_ns, "last_window_ns": inc.last_window_ns,
            "max_score": inc.max_score, "threshold": None if math.isnan(inc.threshold) else inc.threshold,
            "window_count": inc.window_count,
            "window_starts": sorted(inc.window_starts)[-MAX_WINDOW_STARTS:],
            "kb_entries": inc.kb_entries, "last_seen_wall_ns": last_seen_wall_ns}


def parse(raw: bytes) -> list[tuple[Incident, int]]:
    """The incidents of a saved document and when each last saw a window; IncidentFileError names the fault."""
    try:
        doc = json.loads(raw)
    except ValueError as exc:  # also UnicodeDecodeError
        raise IncidentFileError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or "version" not in doc:
        raise IncidentFileError("not a saved incident list (no version)")
    if doc["version"] != VERSION:
        raise IncidentFileError(f"version {doc['version']!r}, this fleetscope reads version {VERSION}")
    items = doc.get("incidents")
    if not isinstance(items, list) or len(items) > MAX_INCIDENTS:
        raise IncidentFileError(f"'incidents' must be a list of at most {MAX_INCIDENTS}")
    out = []
    for i, item in enumerate(items):
        try:
            out.append(parse_incident(item))
        except (KeyError, TypeError, ValueError) as exc:
            raise IncidentFileError(f"incident {i}: missing or mistyped {exc}") from None
    return out


def parse_incident(item: dict) -> tuple[Incident, int]:
    def integer(name: str) -> int:
        value = item[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(name)
        return value

    def text(name: str) -> str:
        value = item[name]
        if not isinstance(value, str):
            raise TypeError(name)
        return value

    starts = item["window_starts"]
    kb = item["kb_entries"]
    if not isinstance(starts, list) or len(starts) > MAX_WINDOW_STARTS \
            or any(isinstance(s, bool) or not isinstance(s, int) for s in starts):
        raise TypeError("window_starts")
    if not isinstance(kb, dict) or any(not isinstance(v, (int, float)) or isinstance(v, bool) for v in kb.values()):
        raise TypeError("kb_entries")
    threshold = item["threshold"]
    inc = Incident(IncidentKey(text("tenant"), text("job"), text("host"), integer("rank")), text("role"),
                   integer("first_window_ns"), integer("last_window_ns"), float(item["max_score"]),
                   float("nan") if threshold is None else float(threshold),
                   window_starts=set(starts), kb_entries={str(e): float(c) for e, c in kb.items()})
    inc.window_count = max(integer("window_count"), len(starts))
    return inc, integer("last_seen_wall_ns")
