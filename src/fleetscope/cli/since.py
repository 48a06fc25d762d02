"""`--since` values (a duration back from now, or an ISO time) and the UTC times the diagnosis commands print."""
from __future__ import annotations

import re
import time
from datetime import datetime, timezone

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str, now_s: float | None = None) -> int:
    """'30m' / '6h' / '7d' back from now, or an ISO time (UTC if no zone), as epoch ms."""
    now_s = time.time() if now_s is None else now_s
    m = _DURATION.match(text.strip())
    if m:
        return int((now_s - float(m.group(1)) * _UNIT_S[m.group(2)]) * 1000)
    try:
        dt = datetime.fromisoformat(text.strip())
    except ValueError:
        raise SystemExit(f"--since expects a duration like 30m, 6h, 7d or an ISO time, got {text!r}") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp() * 1000)


def iso_utc(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
