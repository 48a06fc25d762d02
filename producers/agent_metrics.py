"""The agent's /metrics: its health counters in the Prometheus text format, read when Prometheus scrapes.

Nothing on the sampling path changes: a collector reads the same numbers the agent publishes as its
`agent` health events (the publisher's counters, events sampled, and each stat source, such as the tracer
manager's errors and the governor's duties), plus the probe hits per family its overhead governor counts,
so a scrape costs the agent nothing between scrapes.
"""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fleetscope.metrics_endpoint import MetricsEndpoint

log = logging.getLogger(__name__)

# publisher and agent counters -> (metric, help); the reason-labelled drops are below
COUNTERS = {
    "events_sampled": ("fleetscope_agent_events_sampled", "events the samplers and tracers produced"),
    "events_sent": ("fleetscope_agent_events_sent", "events Kafka acknowledged"),
    "batches_sent": ("fleetscope_agent_batches_sent", "batches Kafka acknowledged"),
    "delivery_errors": ("fleetscope_agent_delivery_errors", "failed delivery reports, outages included"),
    "split_batches": ("fleetscope_agent_split_batches", "batches cut to fit the broker's message size"),
    "producer_restarts": ("fleetscope_agent_producer_restarts", "Kafka producer restarts"),
    "trace_errors": ("fleetscope_agent_tracer_errors", "errors raised by eBPF tracers (each is logged)"),
}
GAUGES = {
    "spooled": ("fleetscope_agent_spooled_batches", "batches waiting in the spool for Kafka"),
    "spooled_bytes": ("fleetscope_agent_spooled_bytes", "bytes waiting in the spool for Kafka"),
    "in_flight": ("fleetscope_agent_in_flight_batches", "batches handed to Kafka, not yet acknowledged"),
    "spool_dir_bytes": ("fleetscope_agent_spool_dir_bytes", "bytes of the on-disk spool"),
    "trace_targets": ("fleetscope_agent_trace_targets", "processes the tracers are attached to"),
    "trace_tracers_running": ("fleetscope_agent_tracers_running", "eBPF tracers running"),
    "trace_budget_used_frac": ("fleetscope_agent_trace_budget_used_ratio",
                               "share of the overhead budget the probe hits used in the last governor period"),
}
DROPS = {"dropped_overflow_batches": "spool_overflow", "dropped_permanent_batches": "refused",
         "dropped_oversize_rows": "oversize_row"}


def agent_stats(agent) -> dict:
    """What the agent's health event carries, read without touching its loop."""
    return agent.stats(scrape=True)


class AgentCollector:
    def __init__(self, agent):
        self.agent = agent

    def collect(self):
        stats = agent_stats(self.agent)
        host = self.agent.cfg.host
        for key, (name, doc) in COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=["host"])
            c.add_metric([host], float(stats.get(key, 0)))
            yield c
        for key, (name, doc) in GAUGES.items():
            if key in stats:
                g = GaugeMetricFamily(name, doc, labels=["host"])
                g.add_metric([host], float(stats[key]))
                yield g
        drops = CounterMetricFamily("fleetscope_agent_dropped", "batches (rows for oversize_row) dropped, by reason",
                                    labels=["host", "reason"])
        for key, reason in DROPS.items():
            drops.add_metric([host, reason], float(stats.get(key, 0)))
        yield drops
        rejected = CounterMetricFamily("fleetscope_agent_identity_rejected", "identity values (from the configured "
                                       "variables or the tenant sources) refused as names: not published",
                                       labels=["host", "kind"])
        for kind in ("tenant", "job"):
            rejected.add_metric([host, kind], float(stats.get(f"identity_rejected_{kind}", 0)))
        yield rejected
        duty = GaugeMetricFamily("fleetscope_agent_governor_duty_ratio",
                                 "share of each governor period a probe family is attached", labels=["host", "tracer", "family"])
        shed = GaugeMetricFamily("fleetscope_agent_governor_shed",
                                 "1 while an always-on family is detached for exceeding the budget alone",
                                 labels=["host", "tracer", "family"])
        for key, value in stats.items():
            for prefix, family in (("trace_duty.", duty), ("trace_shed.", shed)):
                if key.startswith(prefix):
                    tracer, _, fam = key[len(prefix):].partition(".")
                    family.add_metric([host, tracer, fam], float(value))
        yield duty
        yield shed
        hits = CounterMetricFamily("fleetscope_agent_probe_hits", "probe hits per tracer and family, as the "
                                   "governor counted them at its last period", labels=["host", "tracer", "family"])
        for (tracer, fam), n in probe_hits(self.agent).items():
            hits.add_metric([host, tracer, fam], float(n))
        yield hits


def probe_hits(agent) -> dict[tuple[str, str], int]:
    """(tracer, family) -> cumulative hits, from the overhead governor of the agent's tracer manager (the
    `trace` source holds it as .manager once its programs compiled; a bare manager is its own)."""
    out: dict[tuple[str, str], int] = {}
    for source in list(agent.stat_sources):
        governor = getattr(getattr(source, "manager", source), "governor", None)
        if governor is None:
            continue
        try:
            families = list(governor.families.items())
        except RuntimeError:  # a tracer (un)registered during this scrape: report it at the next
            continue
        for key, state in families:
            out[key] = out.get(key, 0) + int(state.last_hits)
    return out


def metrics_registry(agent) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(AgentCollector(agent))
    return registry


def start_agent_metrics(cfg, agent) -> MetricsEndpoint:
    return MetricsEndpoint.from_config(cfg, metrics_registry(agent), "agent").start()
