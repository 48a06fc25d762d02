"""The sink's write-ahead poll plan: which offsets the poll being stored holds.

A sink stores a poll, then commits it. Killed in between, it is replayed
from the committed offsets, and the replay's poll is usually larger (more
arrived meanwhile) and grouped differently, so its inserts carry other
dedupe tokens and the store keeps both copies until a merge. The plan is
written before a poll's inserts run and cleared once its offsets are
committed; a sink that finds one replays exactly those records first, as one
poll, so the same records make the same inserts with the same tokens and the
store drops the copy (insert_deduplication_token, non_replicated_deduplication_window).

Kafka commit metadata would be the natural home, but the embedded broker
(tansu) does not keep it; the plan is a file in the data directory, which
one sink owns (chDB allows one process per data directory).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)
Ranges = dict[tuple[str, int], tuple[int, int]]  # (topic, partition) -> (first, last offset), inclusive


class PollPlan:
    def __init__(self, path: Path | None):
        self.path = path

    def write(self, records) -> None:
        if self.path is None:
            return
        ranges: Ranges = {}
        for r in records:
            first, last = ranges.get((r.topic, r.partition), (r.offset, r.offset))
            ranges[(r.topic, r.partition)] = (min(first, r.offset), max(last, r.offset))
        doc = [[t, p, first, last] for (t, p), (first, last) in sorted(ranges.items())]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.path)  # a kill leaves the old plan or the new one, never half of one

    def clear(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def load(self) -> Ranges:
        if self.path is None or not self.path.exists():
            return {}
        try:
            doc = json.loads(self.path.read_text())
            return {(str(t), int(p)): (int(first), int(last)) for t, p, first, last in doc}
        except (OSError, ValueError, TypeError) as exc:  # unreadable: replays then regroup (duplicates until a merge)
            log.warning("the sink's poll plan %s is unreadable (%s); replaying without it", self.path, exc)
            return {}
