"""The node agent loop: sample its sources on a fixed cadence, publish, report its own health.

What it samples comes from the source registry (producers/sources.py), by name from the configuration.
The agent's own counters (sent, spooled, dropped) and each source's stats go out as `agent` events
every tick, so a drop anywhere on the node is visible downstream.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import asdict

import numpy as np

from fleetscope.config import Config
from fleetscope.schema import node_identity
from fleetscope.wire import Batch, StrColumn
from fleetscope.producers.publisher import Publisher
from fleetscope.producers.sources import Source, build_sources

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
    def __init__(self, cfg: Config, publisher: Publisher, sources: list[Source]):
        self.cfg = cfg
        self.publisher = publisher
        self.sources = sources  # sampled every tick, their stats() in the health events, closed at the end
        self.closers: list = []  # also called when the run ends (the /metrics endpoint)
        self.ticks = 0
        self.events_sampled = 0
        self.identity_rules: list = []  # each source's resolver's IdentityRules: their rejected names are counted
        self._stop = threading.Event()

    @property
    def stat_sources(self) -> list[Source]:
        """What the health events (and `up`'s status line, and /metrics) read stats() from."""
        return self.sources

    def tick(self) -> None:
        now_ns = time.time_ns()
        for source in self.sources:
            try:
                batch = source.sample(now_ns)
            except Exception:  # a broken source must not stop the others
                log.exception("source %s failed", source.name)
                continue
            for one in (batch if isinstance(batch, list) else [batch] if batch is not None else []):
                self.events_sampled += one.count
                self.publisher.publish(one)
        self.publisher.retry_spool()
        self.publisher.publish(agent_stats_batch(self.cfg.host, self.stats(), now_ns))
        self.ticks += 1

    def stats(self, scrape: bool = False) -> dict:
        """What the health event carries (and /metrics, `scrape`: read from another thread, quietly)."""
        stats = {**asdict(self.publisher.stats), "events_sampled": self.events_sampled}
        for source in list(self.stat_sources):
            try:
                stats.update(source.stats())
            except Exception:  # health reporting must not stop sampling, nor a scrape fail mid-update
                if scrape:
                    log.debug("stats of %s unavailable during this scrape", type(source).__name__, exc_info=True)
                else:
                    log.exception("stats of source %s failed", type(source).__name__)
        for kind in ("tenant", "job"):  # identity values refused as names (producers/identity.py)
            stats[f"identity_rejected_{kind}"] = sum(r.rejected[kind] for r in list(self.identity_rules))
        return stats

    def run(self, duration_s: float | None = None) -> None:
        """Tick every sample_interval_s on a drift-free schedule until stopped, then flush what is held.

        On the main thread, SIGTERM and SIGINT stop the loop the same way, so
        an orchestrator's stop (or Ctrl-C) delivers what the agent holds, for
        at most stop_flush_timeout_s, instead of losing it.
        """
        restore = self._stop_on_signals()
        try:
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
            left = self.publisher.close(self.cfg.stop_flush_timeout_s)
            if left:
                log.warning("%d batches were still undelivered after %.0f s at agent stop",
                            left, self.cfg.stop_flush_timeout_s)
        finally:
            restore()

    def _stop_on_signals(self):
        if threading.current_thread() is not threading.main_thread():
            return lambda: None  # signals reach only the main thread; whoever runs us there stops us
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

        def stop(signum, _frame):
            log.info("%s: stopping; flushing what the agent holds (at most %.0f s)",
                     signal.Signals(signum).name, self.cfg.stop_flush_timeout_s)
            self.stop()
            for sig, handler in previous.items():  # a second signal is not soft
                signal.signal(sig, handler)

        for sig in previous:
            signal.signal(sig, stop)

        def restore():
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return restore

    def stop(self) -> None:
        self._stop.set()

    def _close_parts(self) -> None:
        for close in [source.close for source in self.sources] + self.closers:
            try:
                close()
            except Exception:  # stopping must reach every part
                log.exception("error while stopping %s", close)


def identity_rules(cfg: Config):
    from fleetscope.producers.identity import IdentityRules
    from fleetscope.producers.tenant_sources import TenantSources
    sources = TenantSources(cfg.tenant_map_file, cfg.kubelet_pods)
    return IdentityRules(tenant_env=cfg.tenant_env, default_tenant=cfg.default_tenant, job_env=tuple(cfg.job_env),
                         tenant_env_trusted=cfg.tenant_env_trusted, sources=sources if sources.configured else None)


def build_agent(cfg: Config, bootstrap: str) -> Agent:
    """An agent with every source cfg selects (see producers/sources.py); ConfigError or TenantMapError
    when the configuration cannot work, before anything is sampled."""
    publisher = Publisher(cfg, bootstrap)
    agent = Agent(cfg, publisher, [])
    from fleetscope.producers.agent_metrics import start_agent_metrics
    agent.closers.append(start_agent_metrics(cfg, agent).stop)  # /metrics (metrics_address:metrics_port)

    def new_resolver():  # one per source: each resolves on its own thread, with its own cache
        from fleetscope.producers.identity import IdentityResolver
        rules = identity_rules(cfg)
        agent.identity_rules.append(rules)
        return IdentityResolver(rules, host=cfg.host)
    try:
        agent.sources.extend(build_sources(cfg, new_resolver, publisher.publish))
    except BaseException:
        agent._close_parts()  # the /metrics port is free again for a corrected restart
        raise
    if cfg.trace_capture_s > 0:  # capture around anomalies: a source for its stats, fed by the tracers
        from fleetscope.producers.trace_capture import attach_capture
        capture = attach_capture(cfg, bootstrap, new_resolver(), agent.sources)
        if capture is not None:
            agent.sources.append(capture)
    log.info("agent sources: %s", ", ".join(source.name for source in agent.sources))
    return agent
