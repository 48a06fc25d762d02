"""What the agent holds until Kafka acknowledges it: pending messages, and an optional bounded directory of them.

Like Fluent Bit's and Vector's file buffers, the directory keeps one file per
unacknowledged message, so an agent restarted during a Kafka outage sends
what its predecessor held. A file is written before the message is handed to
the producer and removed once the broker acknowledged it (or it was dropped,
counted). Files are written to a temporary name and renamed, so a crash
leaves either a whole file or none; a file that still does not parse is
moved aside and counted, never silently lost or fatal.

File layout: 4-byte big-endian length of a JSON header, the header (topic,
key, headers, count, order), then the message value. No code is ever
deserialised.
"""
from __future__ import annotations

import base64
import json
import logging
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from fleetscope.private_files import open_private_write, private_dir

log = logging.getLogger(__name__)

SUFFIX = ".msg"
_LEN = struct.Struct(">I")


@dataclass
class Pending:
    """One message on its way to Kafka. `order` sorts messages in the order they were published;
    the parts of a split message sort in place of the whole."""

    order: tuple[int, ...]
    topic: str
    key: bytes
    headers: list[tuple[str, bytes]]
    count: int
    size: int
    value: bytes | None  # None while it lives only in the spool directory
    path: str | None = None  # its file in the spool directory, if any
    attempts: int = 0  # refusals by the broker that were not an outage
    generation: int = field(default=-1, compare=False)  # which producer holds it in flight

    def __lt__(self, other: "Pending") -> bool:  # for heapq: oldest first
        return self.order < other.order


class SpoolDirError(RuntimeError):
    pass


class DiskSpool:
    def __init__(self, directory: str | os.PathLike, max_bytes: int):
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        self.bytes = 0
        self.corrupt = 0
        try:
            private_dir(self.dir)
            probe = self.dir / ".write-test"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise SpoolDirError(f"spool_dir {self.dir} is not a writable directory ({e.strerror}): "
                                f"create it for the agent's user or unset spool_dir") from None

    def _name(self, order: tuple[int, ...]) -> str:
        return "-".join(f"{o:016d}" for o in order) + SUFFIX

    def write(self, item: Pending) -> None:
        if item.path is not None:
            return
        header = json.dumps({"order": list(item.order), "topic": item.topic,
                             "key": base64.b64encode(item.key).decode(),
                             "headers": [[k, base64.b64encode(v).decode()] for k, v in item.headers],
                             "count": item.count, "attempts": item.attempts}).encode()
        path = self.dir / self._name(item.order)
        tmp = path.with_suffix(".tmp")
        with open_private_write(tmp) as f:
            f.write(_LEN.pack(len(header)) + header)
            f.write(item.value)
        os.replace(tmp, path)
        item.path = str(path)
        self.bytes += item.size

    def read_value(self, item: Pending) -> bytes:
        with open(item.path, "rb") as f:
            data = f.read()
        (n,) = _LEN.unpack_from(data)
        return data[_LEN.size + n:]

    def remove(self, item: Pending) -> None:
        if item.path is None:
            return
        try:
            os.unlink(item.path)
        except FileNotFoundError:
            pass
        self.bytes -= item.size
        item.path = None

    def load(self) -> list[Pending]:
        """What a previous agent left, oldest first, with values left on disk."""
        items = []
        for path in sorted(self.dir.glob("*" + SUFFIX)):
            try:
                with open(path, "rb") as f:
                    head = f.read(_LEN.size)
                    (n,) = _LEN.unpack(head)
                    meta = json.loads(f.read(n))
                    size = os.fstat(f.fileno()).st_size - _LEN.size - n
                items.append(Pending(order=tuple(int(o) for o in meta["order"]), topic=str(meta["topic"]),
                                     key=base64.b64decode(meta["key"]),
                                     headers=[(str(k), base64.b64decode(v)) for k, v in meta["headers"]],
                                     count=int(meta["count"]), size=size, value=None, path=str(path),
                                     attempts=int(meta.get("attempts", 0))))
                self.bytes += size
            except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
                self.corrupt += 1
                log.warning("spool file %s is unreadable (%s): moved aside as %s.bad", path, e, path.name)
                os.replace(path, path.with_name(path.name + ".bad"))
        for tmp in self.dir.glob("*.tmp"):  # a write the previous agent did not finish: never handed to Kafka
            tmp.unlink(missing_ok=True)
        items.sort()
        return items
