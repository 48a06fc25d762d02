"""The agent's /metrics counts probe hits per tracer family: a real uprobe (libc's getppid, tests/support's
LibcCallTracer) on a real process calling it in a loop, run by the real tracer manager and its governor, inside
an agent whose endpoint is scraped over HTTP and parsed with prometheus_client's text parser."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetscope.producers.agent import Agent
from fleetscope.producers.agent_metrics import start_agent_metrics
from fleetscope.producers.publisher import Publisher
from fleetscope.producers.tracers.manager import TracerManager

# calls getppid until its stdin closes
_LOOP = r"""
import ctypes, sys, threading
f = ctypes.CDLL(None).getppid
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
print("ready", flush=True)
while not done.is_set():
    for _ in range(1000):
        f()
"""


def hits(url: str) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    return {(s.labels["tracer"], s.labels["family"]): s.value for s in fams["fleetscope_agent_probe_hits"].samples}


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="loading BPF programs needs root (CI runs as root)")
def test_the_agents_metrics_count_probe_hits_per_tracer_family(pipeline_cfg, broker):
    from support.libc_call_tracer import LibcCallTracer

    child = subprocess.Popen([sys.executable, "-c", _LOOP], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    cfg = replace(pipeline_cfg, trace_pids=(str(child.pid),), trace_auto=False, trace_duty_period_s=0.5)
    tracer = LibcCallTracer()
    manager = TracerManager(cfg, tracers={"libc": tracer}, hit_cost_ns=6000.0)
    publisher = Publisher(cfg, broker.bootstrap)
    agent = Agent(cfg, publisher, [manager])
    endpoint = start_agent_metrics(cfg, agent)
    try:
        assert hits(endpoint.url) == {("libc", "getppid"): 0}  # registered; no governor period has ended yet
        manager.start()
        deadline = time.monotonic() + 60
        while not (first := hits(endpoint.url)).get(("libc", "getppid")):
            assert time.monotonic() < deadline, f"no probe hits on /metrics; the tracer counted {tracer.hits()}"
            time.sleep(0.2)
        assert set(first) == {("libc", "getppid")}
        # the governor's count, taken at its last period, never runs ahead of the probe's own
        assert first[("libc", "getppid")] <= tracer.hits()["getppid"]
        deadline = time.monotonic() + 60
        while (later := hits(endpoint.url))[("libc", "getppid")] <= first[("libc", "getppid")]:
            assert time.monotonic() < deadline, "the probe-hit counter did not grow while the loop ran"
            time.sleep(0.2)
    finally:
        endpoint.stop()
        manager.close()
        publisher.close(5)
        child.stdin.close()
        child.wait(30)
