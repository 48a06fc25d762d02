"""`fleetscope up`: the embedded all-in-one, with a live status line.

Parts: the tansu broker (unless a Kafka is configured), one streams worker in
a child process (it owns chDB and serves the loopback endpoint), and the node
agent in a thread here. Ctrl-C stops them in order: the agent flushes, the
worker commits what it stored, then the broker goes. Children die with us
even if we are killed (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from dataclasses import replace

from fleetscope.broker import EmbeddedBroker, die_with_parent
from fleetscope.config import Config
from fleetscope.topics import RAW_SOURCES, all_topics, ensure_topics

log = logging.getLogger(__name__)


def fetch_stats(data_dir) -> dict | None:
    """The streams worker's counters, through its loopback endpoint."""
    try:
        info = json.loads((data_dir / "endpoint.json").read_text())
        req = urllib.request.Request(info["url"].rstrip("/") + "/stats",
                                     headers={"Authorization": f"Bearer {info['token']}"})
        with urllib.request.urlopen(req, timeout=1.0) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError, KeyError):
        return None


class LagProbe:
    """Committed-offset lag of the streams consumer group, summed over partitions."""

    def __init__(self, bootstrap: str, group: str, topics: list[str]):
        from confluent_kafka import Consumer
        self._consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                                   "enable.auto.commit": False})
        self._topics = topics

    def lag(self) -> int | None:
        from confluent_kafka import TopicPartition
        try:
            meta = self._consumer.list_topics(timeout=1.0)
            tps = [TopicPartition(t, p) for t in self._topics if t in meta.topics
                   for p in meta.topics[t].partitions]
            committed = self._consumer.committed(tps, timeout=1.0)
            total = 0
            for tp in committed:
                low, high = self._consumer.get_watermark_offsets(tp, timeout=1.0)
                total += high - (tp.offset if tp.offset >= 0 else low)
            return total
        except Exception:  # status is best effort; the worker's health does not depend on it
            return None

    def close(self) -> None:
        self._consumer.close()


def _status_line(elapsed: float, agent, stats: dict | None, rate: float, lag) -> str:
    pub = agent.publisher.stats
    line = (f"up {elapsed:5.0f}s | agent: {agent.events_sampled:,} events sampled, "
            f"{pub.batches_sent:,} batches sent, {pub.dropped_events:,} dropped")
    if stats is None:
        return line + " | streams: starting…"
    last = stats.get("last_window_end_ns") or 0
    last_s = time.strftime("%H:%M:%S", time.localtime(last / 1e9)) if last else "-"
    line += (f" | streams: {rate:,.0f} events/s in, {stats['windows_out']:,} windows out (last {last_s}), "
             f"lag {'?' if lag is None else lag} msgs, DLQ {stats['dlq']}, late {stats['late_events']}")
    if "model_scored" in stats:
        line += (f" | model: {stats['model_scored']:,} scored, {stats['model_anomalies']:,} anomalies, "
                 f"{stats['model_diagnoses']:,} diagnosed ({stats['model_unmatched']:,} unmatched)")
    for source in agent.stat_sources:  # the /proc sampler; the tracer manager, once its BPF programs are loaded
        t = source.stats()
        if "proc_pids" in t:
            line += f" | sampling {t['proc_pids']} rank processes"
        if "trace_targets" in t:
            line += f" | tracing {t['trace_targets']} processes, {t['trace_tracers_running']} tracers"
    return line


def run_up(cfg: Config, duration_s: float | None = None, plain: bool = False) -> int:
    from fleetscope.producers.agent import build_agent
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    broker = None
    streams = None
    sink = None
    agent = None
    agent_thread = None
    try:
        bootstrap = cfg.kafka
        if not bootstrap:
            broker = EmbeddedBroker(cfg.embedded_broker_port, log_path=cfg.data_dir / "broker.log").start()
            bootstrap = broker.bootstrap
        ensure_topics(bootstrap, all_topics(cfg), cfg.partitions)
        env = {**os.environ, "FLEETSCOPE_KAFKA": bootstrap, "FLEETSCOPE_DATA_DIR": str(cfg.data_dir)}
        # the sink owns chDB and the loopback endpoint; the worker only computes and publishes
        sink = subprocess.Popen([sys.executable, "-m", "fleetscope", "sink"], env=env,
                                stdout=open(cfg.data_dir / "sink.log", "ab"), stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent)
        worker_log = open(cfg.data_dir / "streams.log", "ab")
        streams = subprocess.Popen([sys.executable, "-m", "fleetscope", "streams"],
                                   env={**os.environ, "FLEETSCOPE_KAFKA": bootstrap,
                                        "FLEETSCOPE_DATA_DIR": str(cfg.data_dir)},
                                   stdout=worker_log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        agent = build_agent(replace(cfg, kafka=bootstrap), bootstrap)
        agent_thread = threading.Thread(target=agent.run, name="agent", daemon=True)
        agent_thread.start()
        print(f"fleetscope up: broker {bootstrap}" + (f" (embedded, pid {broker.pid})" if broker else "")
              + f", streams worker pid {streams.pid}, store {cfg.clickhouse_url or cfg.data_dir / 'chdb'}."
              + " Ctrl-C stops everything.", flush=True)
        _watch(cfg, agent, streams, bootstrap, duration_s, plain)
    except KeyboardInterrupt:
        pass
    finally:
        _shutdown(agent, agent_thread, streams, broker, sink)
    return 0 if streams is None or streams.returncode in (0, -signal.SIGTERM, None) else 1


def _watch(cfg, agent, streams, bootstrap, duration_s, plain) -> None:
    from rich.console import Console
    from rich.live import Live
    probe = LagProbe(bootstrap, cfg.consumer_group, [cfg.raw_topic(s) for s in RAW_SOURCES])
    console = Console(stderr=False)
    start = time.monotonic()
    history: deque = deque(maxlen=6)  # (time, events_in): the rate is smoothed over ~5 s
    live = None if plain or not console.is_terminal else Live(console=console, refresh_per_second=4)
    if live:
        live.start()
    try:
        while duration_s is None or time.monotonic() - start < duration_s:
            time.sleep(1.0)
            if streams.poll() is not None:
                raise SystemExit(f"the streams worker exited with code {streams.returncode}; "
                                 f"see {cfg.data_dir / 'streams.log'}")
            stats = fetch_stats(cfg.data_dir)
            now = time.monotonic()
            rate = 0.0
            if stats is not None:
                history.append((now, stats["events_in"]))
                (t0, e0), (t1, e1) = history[0], history[-1]
                rate = (e1 - e0) / (t1 - t0) if t1 > t0 else 0.0
            line = _status_line(now - start, agent, stats, rate, probe.lag())
            if live:
                live.update(line)
            else:
                print(line, flush=True)
    finally:
        if live:
            live.stop()
        probe.close()


def _shutdown(agent, agent_thread, streams, broker, sink=None) -> None:
    if agent is not None:
        agent.stop()
        if agent_thread is not None:
            agent_thread.join(15)  # lets the publisher flush what it holds
    for proc in (streams, sink):  # the worker publishes what it holds, then the sink stores it
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if broker is not None:
        broker.stop()
