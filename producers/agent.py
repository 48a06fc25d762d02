"""The node agent loop: sample on a fixed cadence, publish, report its own health.

The agent's own counters (sent, spooled, dropped) go out as `agent` events
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
        self.samplers = samplers  # objects with .sample(now_ns) -> Batch | list[Batch] | None
        self.stat_sources: list = []  # objects with .stats() -> dict, merged into the agent's health events
        self.closers: list = []  # called when the run ends (watcher threads, NVML handles)
        self.ticks = 0
        self.events_sampled = 0
        self._stop = threading.Event()
        self.parts_lock = threading.Lock()  # parts that join late (tracers) vs. the run ending
        self.stopped = False

    def tick(self) -> None:
        now_ns = time.time_ns()
        for sampler in self.samplers:
            try:
                batch = sampler.sample(now_ns)
            except Exception:  # a broken sampler must not stop the others
                log.exception("sampler %s failed", type(sampler).__name__)
                continue
            for one in (batch if isinstance(batch, list) else [batch] if batch is not None else []):
                self.events_sampled += one.count
                self.publisher.publish(one)
        self.publisher.retry_spool()
        stats = {**asdict(self.publisher.stats), "events_sampled": self.events_sampled}
        for source in self.stat_sources:
            try:
                stats.update(source.stats())
            except Exception:  # health reporting must not stop sampling
                log.exception("stats of %s failed", type(source).__name__)
        self.publisher.publish(agent_stats_batch(self.cfg.host, stats, now_ns))
        self.ticks += 1

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
        with self.parts_lock:
            self.stopped = True
        for close in self.closers:
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
    from fleetscope.producers.host.collector import build_collectors
    from fleetscope.producers.host.sampler import HostSampler
    collectors = build_collectors(list(cfg.collectors) if cfg.collectors else None)
    publisher = Publisher(cfg, bootstrap)
    agent = Agent(cfg, publisher, [HostSampler(cfg.host, collectors)])
    from fleetscope.producers.agent_metrics import start_agent_metrics
    agent.closers.append(start_agent_metrics(cfg, agent).stop)  # /metrics (metrics_address:metrics_port)
    if cfg.nvml:
        from fleetscope.producers.identity import IdentityResolver
        from fleetscope.producers.nvml.sampler import NvmlSampler
        from fleetscope.producers.nvml.xid_watcher import XidWatcher
        nvml = NvmlSampler(cfg.host, resolver=IdentityResolver(identity_rules(cfg), host=cfg.host), library_path=cfg.nvml_library)
        agent.samplers.append(nvml)
        agent.closers.append(nvml.close)
        # XID and other critical events are published the moment they happen, not on the tick
        watcher = XidWatcher(cfg.host, publisher.publish, library_path=cfg.nvml_library)
        watcher.start()
        agent.closers.append(watcher.stop)
    if cfg.proc_sampling:  # reads /proc only: runs without root
        from fleetscope.producers.identity import IdentityResolver
        from fleetscope.producers.process_sampler import ProcessSampler
        proc = ProcessSampler.from_config(cfg, IdentityResolver(identity_rules(cfg), host=cfg.host))
        agent.samplers.append(proc)
        agent.stat_sources.append(proc)
    if cfg.trace:
        start_tracing(cfg, agent)
    return agent


def start_tracing(cfg: Config, agent: Agent) -> None:
    """Attach the eBPF tracers if this host can run them; without them the agent still samples.

    Compiling the BPF programs and calibrating the probe cost take seconds, so
    this happens on a thread: host and GPU sampling start at once, and the
    tracers join the agent's samplers when they are ready.
    """
    import os
    if os.geteuid() != 0:
        log.warning("eBPF tracing is off: the agent is not root (it needs CAP_BPF and CAP_PERFMON); "
                    "host and GPU sampling continue")
        return
    threading.Thread(target=_start_tracing, args=(cfg, agent), name="tracer-start", daemon=True).start()


def _start_tracing(cfg: Config, agent: Agent) -> None:
    import os
    try:  # Linux nices threads one by one: the BPF compile must not slow the pipeline's start
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except OSError:
        pass
    from fleetscope.producers.identity import IdentityResolver
    from fleetscope.producers.tracers.manager import TracerManager
    try:
        manager = TracerManager(cfg, resolver=IdentityResolver(identity_rules(cfg), host=cfg.host))
    except Exception:  # tracing is an add-on: the agent keeps sampling without it
        log.exception("eBPF tracing is off: the tracer manager failed to start")
        return
    if not manager.tracers:
        log.warning("eBPF tracing is off: no tracer could start (%s)", "; ".join(manager.unavailable.values()))
        return
    with agent.parts_lock:
        if agent.stopped:
            manager.close()
            return
        manager.start()
        agent.samplers.append(manager)
        agent.stat_sources.append(manager)
        agent.closers.append(manager.close)
