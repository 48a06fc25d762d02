"""/metrics in the Prometheus text format (prometheus_client) for one process: the agent, the worker or the sink.

Each process has its own registry (nothing lands in prometheus_client's global one by accident) and serves it
on `metrics_address:metrics_port` (the sink: `sink_metrics_port`): loopback by default, a configured address in
deployments; port -1 turns it off and 0 takes any free port. The URL it got is written to
`<data_dir>/metrics-<role>.json`, so `fleetscope up` (agent, worker and sink on one machine) and tests find them.
When the configured port is taken, the endpoint takes a free one and says so in one log line rather than
stopping the process it watches.

JobSeries keeps labelled series bounded: it remembers when each job last updated, and removes every labelset
of a job idle for longer than `expire_s`.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)


class MetricsEndpoint:
    def __init__(self, registry: CollectorRegistry, role: str, address: str, port: int, data_dir: Path | None):
        self.registry = registry
        self.role = role
        self.address = address
        self.port = port
        self.data_dir = data_dir
        self.server = None

    @classmethod
    def from_config(cls, cfg, registry: CollectorRegistry, role: str) -> "MetricsEndpoint":
        return cls(registry, role, cfg.metrics_address, cfg.metrics_port, cfg.data_dir)

    @property
    def url(self) -> str | None:
        if self.server is None:
            return None
        host = self.address if ":" not in self.address else f"[{self.address}]"
        return f"http://{host}:{self.server.server_port}/metrics"

    @property
    def info_path(self) -> Path | None:
        return None if self.data_dir is None else Path(self.data_dir) / f"metrics-{self.role}.json"

    def start(self) -> "MetricsEndpoint":
        if self.port < 0:
            return self
        try:
            self.server, _ = start_http_server(self.port, self.address, registry=self.registry)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or self.port == 0:
                log.warning("%s /metrics is off: cannot listen on %s:%d (%s)", self.role, self.address, self.port,
                            exc.strerror)
                return self
            self.server, _ = start_http_server(0, self.address, registry=self.registry)
            log.warning("%s /metrics: port %d is taken (another fleetscope process here?); serving on %d instead",
                        self.role, self.port, self.server.server_port)
        if self.info_path is not None:
            try:
                self.info_path.parent.mkdir(parents=True, exist_ok=True)
                self.info_path.write_text(json.dumps({"url": self.url, "pid": os.getpid()}))
            except OSError as exc:  # the endpoint works without its note
                log.warning("could not write %s: %s", self.info_path, exc.strerror)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        if self.info_path is not None:
            try:
                if json.loads(self.info_path.read_text()).get("pid") == os.getpid():
                    self.info_path.unlink()
            except (OSError, ValueError):
                pass


def read_metrics_url(data_dir: Path, role: str) -> str | None:
    """The URL a running process of this role serves /metrics on, from its note in data_dir."""
    try:
        return json.loads((Path(data_dir) / f"metrics-{role}.json").read_text())["url"]
    except (OSError, ValueError, KeyError):
        return None


class JobSeries:
    """Labelsets per (tenant, job), removed from their metrics once the job is idle for expire_s."""

    def __init__(self, expire_s: float, clock=time.monotonic):
        self.expire_s = expire_s
        self.clock = clock
        self.last: dict[tuple[str, str], float] = {}
        self.labelsets: dict[tuple[str, str], set[tuple[object, tuple[str, ...]]]] = {}

    def touch(self, tenant: str, job: str, metric, labels: tuple[str, ...]) -> None:
        key = (tenant, job)
        self.last[key] = self.clock()
        self.labelsets.setdefault(key, set()).add((metric, labels))

    def forget(self, tenant: str, job: str, metric, labels: tuple[str, ...]) -> None:
        """Remove one labelset now (e.g. a rank whose role label changed)."""
        self.labelsets.get((tenant, job), set()).discard((metric, labels))
        _remove(metric, labels)

    def expire(self) -> int:
        """Remove the series of idle jobs; returns how many labelsets went."""
        now = self.clock()
        gone = 0
        for key in [k for k, t in self.last.items() if now - t > self.expire_s]:
            for metric, labels in self.labelsets.pop(key, ()):
                _remove(metric, labels)
                gone += 1
            del self.last[key]
        return gone


def _remove(metric, labels: tuple[str, ...]) -> None:
    try:
        metric.remove(*labels)
    except KeyError:  # already gone
        pass
