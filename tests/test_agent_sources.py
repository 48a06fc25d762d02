"""The agent's sources: one protocol, one registry line each, selected by name from the configuration.

This machine has no GPU and no NVML library: the nvml and xid sources run as they do on such a node (one
nvml.status row each). The tracer-manager tests give the real TracerManager one stand-in tracer (an object
with sample/close), because what is under test is when the manager joins and leaves the agent; the real
bcc tracers behind the manager are tested in test_tracing_pipeline.py and the tracer tests.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
from confluent_kafka import Consumer, TopicPartition

from fleetscope import wire
from fleetscope.config import Config, ConfigError, load
from fleetscope.producers import sources as sources_mod
from fleetscope.producers.agent import Agent, build_agent
from fleetscope.producers.sources import SOURCES, Source, SourceEntry, build_sources, selected_sources
from fleetscope.producers.tenant_sources import TenantMapError
from fleetscope.producers.tracers.manager import TracerManager
from fleetscope.producers.tracing_source import TracingSource
from support import counting_source
from support.processes import wait_until

BROKEN_TENANT_MAP = '[pods]\n"uid-1" = "no-slash"\n'  # a pod must be "namespace/pod"


def test_the_default_set_and_its_order_come_from_the_registry():
    assert selected_sources(Config()) == list(SOURCES) == ["host", "nvml", "xid", "proc", "trace"]


@pytest.mark.parametrize("env, running", [
    ({"FLEETSCOPE_NVML": "false"}, ["host", "proc", "trace"]),  # nvml = false: no NVML sampler, no XID watcher
    ({"FLEETSCOPE_PROC_SAMPLING": "false"}, ["host", "nvml", "xid", "trace"]),
    ({"FLEETSCOPE_TRACE": ""}, ["host", "nvml", "xid", "proc"]),
    ({"FLEETSCOPE_TRACE": "kernel"}, ["host", "nvml", "xid", "proc", "trace"]),
    ({"FLEETSCOPE_SOURCES": "proc,host"}, ["host", "proc"]),  # by name, in the registry's order
    ({"FLEETSCOPE_SOURCES": "host,nvml,xid", "FLEETSCOPE_NVML": "false"}, ["host"]),  # the switch still wins
])
def test_the_documented_settings_select_the_sources(env, running):
    assert selected_sources(load(env=env)) == running


def test_an_unknown_source_name_is_a_configuration_error_naming_the_known_ones():
    with pytest.raises(ConfigError, match=r"sources=\['host', 'gpu'\]: unknown \['gpu'\]; known: \['host', 'nvml'"):
        selected_sources(Config(sources=("host", "gpu")))


def test_every_registered_source_builds_here_and_speaks_the_protocol():
    published = []
    built = build_sources(Config(host="node-s", trace=()), lambda: None, published.append)
    try:
        assert [s.name for s in built] == ["host", "nvml", "xid", "proc"]
        for source in built:
            assert isinstance(source, Source), source
            assert isinstance(source.stats(), dict)
        by_name = {s.name: s for s in built}
        assert by_name["host"].sample(time.time_ns()).source == "host"
        status = by_name["nvml"].sample(time.time_ns())  # no NVML here: its status row, once
        assert status.source == "nvml" and "nvml.status" in status.columns["metric"].values
        # the XID watcher publishes on its own thread: its status row arrives without a tick
        wait_until(lambda: any(b.source == "nvml" for b in published), 30)
    finally:
        for source in built:
            source.close()
    assert not by_name["xid"].watcher.running


@pytest.fixture
def counting_registered(monkeypatch):
    """One more line in the registry, as a new source adds it."""
    monkeypatch.setitem(SOURCES, "counting", SourceEntry("support.counting_source"))
    counting_source.BUILT.clear()
    return counting_source.BUILT


def read_rows(bootstrap: str, topics: list[str], partitions: int, enough, timeout_s: float = 60.0) -> list[tuple]:
    """(topic source, metric, value) of every row on the topics, read until enough(rows) holds."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "sources-readback", "fetch.wait.max.ms": 10,
                         "enable.auto.commit": False})
    consumer.assign([TopicPartition(t, p, 0) for t in topics for p in range(partitions)])
    rows: list[tuple] = []
    deadline = time.monotonic() + timeout_s
    try:
        while not enough(rows) and time.monotonic() < deadline:
            for m in consumer.consume(100, 0.5):
                if m.error():
                    continue
                batch = wire.decode(m.value(), m.headers())
                metric = batch.columns["metric"]
                rows += [(batch.source, metric.values[c], float(v))
                         for c, v in zip(metric.codes, batch.columns["value"])]
    finally:
        consumer.close()
    return rows


def test_a_new_source_is_its_module_and_one_registry_line(pipeline_cfg, broker, counting_registered):
    cfg = replace(pipeline_cfg, sources=("host", "counting"), metrics_port=-1)
    agent = build_agent(replace(cfg, kafka=broker.bootstrap), broker.bootstrap)
    assert [s.name for s in agent.sources] == ["host", "counting"]
    thread = threading.Thread(target=agent.run, kwargs={"duration_s": 1.2})
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    source = counting_registered[-1]
    assert source.closed and source.ticks == agent.ticks >= 2

    def enough(rows):
        ticks = [v for s, m, v in rows if m == "test.tick"]
        health = [v for s, m, v in rows if m == "agent.counting_ticks"]
        return len(ticks) == source.ticks and len(health) == agent.ticks

    rows = read_rows(broker.bootstrap, [cfg.raw_topic("host"), cfg.raw_topic("agent")], cfg.partitions, enough)
    assert sorted(v for s, m, v in rows if m == "test.tick") == [float(i) for i in range(1, source.ticks + 1)]
    # its stats() rides in the agent's health events, one per tick
    assert sorted(v for s, m, v in rows if m == "agent.counting_ticks") == [float(i) for i in range(1, agent.ticks + 1)]
    assert {s for s, m, v in rows if m == "test.tick"} == {"host"}


def test_a_source_failing_to_build_stops_the_ones_already_running(tmp_path, counting_registered, monkeypatch):
    monkeypatch.setattr(sources_mod, "SOURCES", {"counting": SOURCES["counting"], **SOURCES})  # built before proc
    bad = tmp_path / "tenants.toml"
    bad.write_text(BROKEN_TENANT_MAP)
    cfg = Config(host="node-s", sources=("counting", "proc"), tenant_map_file=bad, metrics_port=-1)
    with pytest.raises(TenantMapError, match="must be"):
        build_agent(cfg, "127.0.0.1:1")
    assert counting_registered[-1].closed


class StandInTracer:
    """Stands in for a bcc tracer (see the module docstring): one row per sample, and it records close()."""

    def __init__(self):
        self.closed = False

    def sample(self, now_ns):
        return counting_source.CountingSource("node-t").sample(now_ns)

    def close(self):
        self.closed = True


def manager_with(tracer) -> TracerManager:
    cfg = Config(host="node-t", trace_auto=False, trace_duty_period_s=0.2, trace_poll_s=0.2)
    return TracerManager(cfg, tracers={"stand": tracer}, hit_cost_ns=6000.0)


def test_the_tracer_manager_joins_when_ready_and_is_sampled_and_closed_as_a_source():
    tracer = StandInTracer()
    release = threading.Event()
    manager = manager_with(tracer)
    source = TracingSource(lambda: manager if release.wait(30) else None).start()
    assert source.sample(1) == [] and source.stats() == {}  # still compiling: the agent samples without it
    release.set()
    wait_until(lambda: source.manager is not None, 30)
    assert [b.source for b in source.sample(time.time_ns())] == ["host"]
    assert source.stats()["trace_tracers_running"] == 1
    source.close()
    assert tracer.closed and not manager._thread.is_alive()


def test_a_tracer_manager_ready_after_the_agent_stopped_is_closed_not_started():
    tracer = StandInTracer()
    release = threading.Event()
    manager = manager_with(tracer)
    source = TracingSource(lambda: manager if release.wait(30) else None).start()
    agent = Agent(Config(host="node-t"), publisher=None, sources=[source])
    agent._close_parts()  # the agent stops while the BPF programs compile
    release.set()
    wait_until(lambda: tracer.closed, 30)
    assert manager._thread is None and source.manager is None  # never started, never sampled


def fleetscope_agent(broker, tmp_path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fleetscope", "agent", "--duration", "1"], capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "FLEETSCOPE_KAFKA": broker.bootstrap, "FLEETSCOPE_DATA_DIR": str(tmp_path),
                               "FLEETSCOPE_TOPIC_PREFIX": f"src{os.getpid()}", "FLEETSCOPE_METRICS_PORT": "-1",
                               "FLEETSCOPE_TRACE": "", **env})


def test_fleetscope_agent_with_a_broken_tenant_map_is_one_line_and_fails(broker, tmp_path):
    bad = tmp_path / "tenants.toml"
    bad.write_text(BROKEN_TENANT_MAP)
    out = fleetscope_agent(broker, tmp_path, FLEETSCOPE_TENANT_MAP_FILE=str(bad))
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        f'fleetscope: tenant_map_file {bad}: [pods] uid-1 = \'no-slash\' must be "namespace/pod"']


def test_fleetscope_agent_with_an_unknown_source_says_which_are_known(broker, tmp_path):
    out = fleetscope_agent(broker, tmp_path, FLEETSCOPE_SOURCES="host,gpus")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "configuration error: sources=['host', 'gpus']: unknown ['gpus']; known: ['host', 'nvml', 'xid', 'proc', 'trace']"]
