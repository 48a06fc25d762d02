"""A job's worker state on `<prefix>.model-state` (compacted, keyed by tenant/job).

One message per job holds what a worker needs to take the job over:
- its model checkpoint (JobModel.to_bytes, base64; absent before the first
  checkpoint and for node keys, which have no model);
- its window marks: per (host, rank), the start of the newest window emitted.

The marks answer "which windows are already out" without the store: a worker
that replays messages after a crash or a rebalance skips windows at or before
a key's mark, so a window is never emitted twice and never as a partial copy.
They are published with every flush that emits windows, in the same Kafka
flush as the windows' own messages and before the input offsets are
committed, so the marks are never behind the committed offsets. The model
bytes are those of the latest checkpoint (every model_checkpoint_s): a worker
restoring them relearns nothing twice, it may only have missed the windows
since that checkpoint, which were scored once by the previous owner.

A state written late (a producer's timed-out first attempt that the broker
still writes after the resend, on another connection) can follow a newer one
on the topic; readers therefore fold each message into what they hold
(`JobState.folded`) instead of taking the last one.

JSON, not pickle: nothing here deserialises code.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

SCHEMA = "model-state/1"
HEADER = "fs-schema"


@dataclass
class JobState:
    tenant: str
    job: str
    model_b64: str | None = None
    saved_at_ns: int = 0
    last_window_ns: int = 0
    marks: dict[tuple[str, int], int] = field(default_factory=dict)

    def folded(self, later: "JobState") -> "JobState":
        """This state and one read after it, as one: the newer of the two by (last_window_ns, saved_at_ns), its
        model included, with every (host, rank) mark at the larger of the two. A mark says a window is out, so
        the larger is right whichever message carried it; event time orders the two even where two workers'
        clocks (saved_at_ns) disagree. A tie goes to `later`, the topic's order."""
        newest, other = ((later, self) if (later.last_window_ns, later.saved_at_ns)
                         >= (self.last_window_ns, self.saved_at_ns) else (self, later))
        marks = dict(other.marks)
        for mk, start in newest.marks.items():
            marks[mk] = max(marks.get(mk, start), start)
        return JobState(newest.tenant, newest.job, newest.model_b64, newest.saved_at_ns, newest.last_window_ns,
                        marks)

    def key(self) -> bytes:
        return f"{self.tenant}/{self.job}".encode()

    def encode(self) -> bytes:
        return json.dumps({"schema": SCHEMA, "tenant": self.tenant, "job": self.job, "model": self.model_b64,
                           "saved_at_ns": int(self.saved_at_ns), "last_window_ns": int(self.last_window_ns),
                           "marks": [[h, int(r), int(s)] for (h, r), s in sorted(self.marks.items())]},
                          separators=(",", ":")).encode()

    @classmethod
    def decode(cls, value: bytes) -> "JobState":
        """Raises ValueError on anything that is not a state message of this schema."""
        try:
            d = json.loads(value)
            if not isinstance(d, dict) or d.get("schema") != SCHEMA:
                raise ValueError(f"not a {SCHEMA} message")
            model = d.get("model")
            if model is not None and not isinstance(model, str):
                raise ValueError("model is not a base64 string")
            marks = {(str(h), int(r)): int(s) for h, r, s in d.get("marks") or []}
            return cls(str(d["tenant"]), str(d["job"]), model, int(d.get("saved_at_ns") or 0),
                       int(d.get("last_window_ns") or 0), marks)
        except (TypeError, KeyError, AttributeError, json.JSONDecodeError) as exc:
            raise ValueError(f"unreadable model-state message: {type(exc).__name__}: {exc}") from None
