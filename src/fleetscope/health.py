"""`python -m fleetscope.health`: the health check of the images (Docker HEALTHCHECK, Kubernetes exec probes).

Healthy when a fleetscope process of this container answers on what it serves: the agent's or the stream
worker's /metrics (each notes its URL in data_dir), or the sink's loopback store endpoint (endpoint.json).
A process that hangs or has not finished starting answers nothing, so it reads as unhealthy.
"""
from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

from fleetscope.config import load
from fleetscope.metrics_endpoint import read_metrics_url

ROLES_WITH_METRICS = ("agent", "worker", "sink")  # a sink on a ClickHouse server serves no store endpoint


def answering(data_dir: Path, timeout_s: float = 5.0) -> str | None:
    """Which of this data_dir's processes answered ("agent /metrics", ..., "sink endpoint"), or None."""
    for role in ROLES_WITH_METRICS:
        url = read_metrics_url(data_dir, role)
        if not url:
            continue
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as reply:
                if reply.status == 200:
                    return f"{role} /metrics"
        except OSError:
            continue
    from fleetscope.store.endpoint import endpoint_alive  # only the sink serves it: the store is not imported before
    if endpoint_alive(data_dir, timeout=timeout_s):
        return "sink endpoint"
    return None


def main() -> int:
    data_dir = load().data_dir
    who = answering(data_dir)
    if who is None:
        print(f"unhealthy: no fleetscope process answers from {data_dir} (no /metrics note, no store endpoint)",
              file=sys.stderr)
        return 1
    print(f"healthy: {who}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
