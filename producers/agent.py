"""The node agent loop: sample on a fixed cadence, publish, report its own health.

The agent's own counters (sent, spooled, dropped) go out as `agent` events
every tick, so a drop anywhere on the node is visible downstream.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict

import numpy as np

from fleetscope.config import Config
from fleetscope.schema import node_identity
from fleetscope.wire import Batch, StrColumn
from producers.publisher import Publisher

log = logging.getLogger(__name__)


def agent_stats_batch(host: str, stats: dict, now_ns: int) -> Batch:
    names = [f"agent.{k}" for k in stats]
    n = len(names)
    cols = {"ts_ns": np.full(n, now_ns, dtype="<i8"), **node_identity(host, n),
            "metric": StrColumn(np.arange(n, dtype=np.uint32), tuple(names)),
            "device": StrColumn.constant("all", n),
            "value": np.array([float(v) for v in stats.values()], dtype="<f8"),
            "interval_ns": np.zeros(n, dtype="<i8")}
    return Batch("agent", host, cols, created_ns=now_ns)


class Agent:
    def __init__(self, cfg: Config, publisher: Publisher, samplers: list):
        self.cfg = cfg
        self.publisher = publisher
        self.samplers = samplers  # objects with .sample(now_ns) -> Batch | None
        self.closers: list = []  # called when the run ends (watcher threads, NVML handles)
        self.ticks = 0
        self.events_sampled = 0
        self._stop = threading.Event()

    def tick(self) -> None:
        now_ns = time.time_ns()
        for sampler in self.samplers:
            try:
                batch = sampler.sample(now_ns)
            except Exception:  # a broken sampler must not stop the others
                log.exception("sampler %s failed", type(sampler).__name__)
                continue
            if batch is not None:
                self.events_sampled += batch.count
                self.publisher.publish(batch)
        self.publisher.retry_spool()
        stats = {**asdict(self.publisher.stats), "events_sampled": self.events_sampled}
        self.publisher.publish(agent_stats_batch(self.cfg.host, stats, now_ns))
        self.ticks += 1

    def run(self, duration_s: float | None = None) -> None:
        """Tick every sample_interval_s on a drift-free schedule until stopped."""
        interval = self.cfg.sample_interval_s
        start = time.monotonic()
        next_at = start
        while not self._stop.is_set():
            self.tick()
            if duration_s is not None and time.monotonic() - start >= duration_s:
                break
            next_at += interval
            self._stop.wait(max(0.0, next_at - time.monotonic()))
        self._close_parts()
        left = self.publisher.flush(10.0)
        if left:
            log.warning("%d batches still undelivered at agent stop", left)

    def stop(self) -> None:
        self._stop.set()

    def _close_parts(self) -> None:
        for close in self.closers:
            try:
                close()
            except Exception:  # stopping must reach every part
                log.exception("error while stopping %s", close)


def identity_rules(cfg: Config):
    from producers.identity import IdentityRules
    return IdentityRules(tenant_env=cfg.tenant_env, default_tenant=cfg.default_tenant, job_env=tuple(cfg.job_env))


def build_agent(cfg: Config, bootstrap: str) -> Agent:
    from producers.host.collector import build_collectors
    from producers.host.sampler import HostSampler
    collectors = build_collectors(list(cfg.collectors) if cfg.collectors else None)
    publisher = Publisher(cfg, bootstrap)
    agent = Agent(cfg, publisher, [HostSampler(cfg.host, collectors)])
    if cfg.nvml:
        from producers.identity import IdentityResolver
        from producers.nvml.sampler import NvmlSampler
        from producers.nvml.xid_watcher import XidWatcher
        nvml = NvmlSampler(cfg.host, resolver=IdentityResolver(identity_rules(cfg), host=cfg.host), library_path=cfg.nvml_library)
        agent.samplers.append(nvml)
        agent.closers.append(nvml.close)
        # XID and other critical events are published the moment they happen, not on the tick
        watcher = XidWatcher(cfg.host, publisher.publish, library_path=cfg.nvml_library)
        watcher.start()
        agent.closers.append(watcher.stop)
    return agent
