"""POST JSON to a receiver; an attempt either succeeds (2xx) or says why it failed, in one line."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Post:
    url: str
    body: object
    what: str  # e.g. "alertmanager acme/train-1 rank 2 open", for logs


def post_json(post: Post, timeout_s: float = TIMEOUT_S) -> str | None:
    """None on success, else the reason it failed."""
    data = json.dumps(post.body).encode()
    req = urllib.request.Request(post.url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            resp.read()
            return None
    except urllib.error.HTTPError as exc:
        return f"{post.url} answered HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"{post.url} unreachable: {reason}"


class Backoff:
    """Exponential backoff between delivery attempts: first_s, doubling, capped at max_s."""

    def __init__(self, first_s: float = 0.25, max_s: float = 30.0):
        self.first_s, self.max_s = first_s, max_s
        self.next_s = first_s

    def wait_s(self) -> float:
        wait = self.next_s
        self.next_s = min(self.next_s * 2, self.max_s)
        return wait

    def reset(self) -> None:
        self.next_s = self.first_s
