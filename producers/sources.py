"""What the agent samples: one protocol, and one registry line per source (node_exporter's collectors, one level up).

A source is anything that turns what the node shows into batches: the host collectors, NVML, the XID
watcher, the per-process /proc sampler, the eBPF tracers. Each one's module has a
`build_source(cfg, new_resolver, publish)` that returns the source, or None after logging once why this
host cannot run it. Adding a source is that module plus one line in SOURCES; the agent builds whatever
the configuration selects from this table, in its order, and knows nothing else about them.

Selection: `sources` names the ones to run (None: every default-enabled one). A source that has its own
on/off setting (`nvml`, `proc_sampling`, `trace`: the settings the agent always had) runs only while that
setting is on, so `nvml = false` still turns NVML and its XID watcher off whatever `sources` says.
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

from fleetscope.config import Config, ConfigError
from fleetscope.wire import Batch

log = logging.getLogger(__name__)


@runtime_checkable
class Source(Protocol):
    name: str

    def sample(self, now_ns: int) -> Batch | list[Batch] | None:
        """What happened since the last call; called once per agent tick."""

    def stats(self) -> dict:
        """Counters merged into the agent's health events ({} when it has none)."""

    def close(self) -> None:
        """Release threads, probes and handles; called once when the agent stops."""


@dataclass(frozen=True)
class SourceEntry:
    module: str                   # the module that defines build_source(cfg, new_resolver, publish)
    default_enabled: bool = True  # runs when `sources` is not set
    switch: str | None = None     # a Config field that, when false or empty, keeps this source off


_P = "fleetscope.producers."
SOURCES: dict[str, SourceEntry] = {
    "host": SourceEntry(_P + "host.sampler"),                              # /proc and /sys, one collector per file
    "nvml": SourceEntry(_P + "nvml.sampler", switch="nvml"),              # every GPU, every tick
    "xid": SourceEntry(_P + "xid_source", switch="nvml"),                 # NVML critical events, as they happen
    "proc": SourceEntry(_P + "process_sampler", switch="proc_sampling"),  # every rank process's /proc (no root)
    "trace": SourceEntry(_P + "tracing_source", switch="trace"),          # the eBPF tracers (root)
}


def selected_sources(cfg: Config) -> list[str]:
    """The names cfg runs, in the registry's order; ConfigError names an unknown one."""
    if cfg.sources is None:
        wanted = [name for name, entry in SOURCES.items() if entry.default_enabled]
    else:
        unknown = sorted(set(cfg.sources) - set(SOURCES))
        if unknown:
            raise ConfigError(f"sources={list(cfg.sources)}: unknown {unknown}; known: {list(SOURCES)}")
        wanted = [name for name in SOURCES if name in cfg.sources]
    chosen = []
    for name in wanted:
        switch = SOURCES[name].switch
        if switch is not None and not getattr(cfg, switch):
            log.info("source %s is off: %s = %r", name, switch, getattr(cfg, switch))
            continue
        chosen.append(name)
    return chosen


def build_sources(cfg: Config, new_resolver: Callable, publish: Callable[[Batch], None]) -> list[Source]:
    """Every selected source this host can run. A configuration error (a broken tenant map, an unknown
    collector) raises: the agent must not start half-configured."""
    sources = []
    try:
        for name in selected_sources(cfg):
            module = importlib.import_module(SOURCES[name].module)
            source = module.build_source(cfg, new_resolver, publish)
            if source is not None:  # its factory said why it cannot run here
                sources.append(source)
    except BaseException:
        for source in sources:  # the ones already running (the XID thread, NVML handles) stop with the error
            source.close()
        raise
    return sources
