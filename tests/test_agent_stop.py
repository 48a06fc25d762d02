"""Stopping the agent delivers what it holds: a real `fleetscope agent` process, a real broker, real signals.

The agent holds batches while its broker does not answer; the test sees them as
files in the agent's spool directory, signals the agent, lets the broker answer
again, and checks that the agent exits 0 only after those batches reached the topic.

The outage is a frozen broker (SIGSTOP, then SIGCONT), not a restarted one: the
embedded broker (tansu) keeps topics in memory only, and a restarted one acknowledges
messages produced before their topic is re-created and then loses them (measured:
three acknowledged sends, one message stored). A real Kafka keeps its topics across a
restart, so freezing is the outage that matches production here.
"""
import base64
import contextlib
import json
import os
import signal
import struct
import subprocess
import sys
import time

import pytest

from fleetscope import wire
from fleetscope.broker import EmbeddedBroker, free_port
from support.batch_rows import rows
from support.raw_topic import read_batches

PREFIX = "stopflush"


def wait_until(condition, timeout_s: float, what: str, proc=None, log=None):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"agent exited early ({proc.returncode}) waiting for {what}:\n{log.read_text()[-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def held_host_batches(spool, topic: str) -> set[str]:
    """Batch ids of the spool's files for `topic` (a file: 4-byte header length, JSON header, message value)."""
    ids = set()
    for path in spool.glob("*.msg"):
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # delivered meanwhile
            continue
        (n,) = struct.unpack_from(">I", data)
        header = json.loads(data[4:4 + n])
        if header["topic"] == topic:
            headers = [(k, base64.b64decode(v)) for k, v in header["headers"]]
            ids.add(wire.decode(data[4 + n:], headers).batch_id)
    return ids


@pytest.mark.integration
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_flushes_the_held_batches_then_exits_0(tmp_path, signum):
    port = free_port()
    topic = f"{PREFIX}.raw.host"
    broker = EmbeddedBroker(port=port, log_path=tmp_path / "broker.log").start()
    spool = tmp_path / "spool"
    log = tmp_path / "agent.log"
    env = {**os.environ, "FLEETSCOPE_KAFKA": broker.bootstrap, "FLEETSCOPE_TOPIC_PREFIX": PREFIX,
           "FLEETSCOPE_PARTITIONS": "1", "FLEETSCOPE_DATA_DIR": str(tmp_path), "FLEETSCOPE_HOST": "node-stop",
           "FLEETSCOPE_NVML": "false", "FLEETSCOPE_PROC_SAMPLING": "false", "FLEETSCOPE_TRACE": "",
           "FLEETSCOPE_COLLECTORS": "meminfo", "FLEETSCOPE_SAMPLE_INTERVAL_S": "0.2",
           "FLEETSCOPE_SPOOL_DIR": str(spool), "FLEETSCOPE_STOP_FLUSH_TIMEOUT_S": "60"}
    agent = subprocess.Popen([sys.executable, "-m", "fleetscope", "agent"], env=env, stdout=open(log, "wb"),
                             stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: read_batches(broker.bootstrap, topic, 1, want_rows=1, timeout_s=1)[0], 60,
                   "the agent's first host batch", agent, log)
        os.kill(broker.pid, signal.SIGSTOP)  # an outage: what the agent samples now, it holds
        try:
            wait_until(lambda: len(held_host_batches(spool, topic)) >= 2, 60, "host batches held in the spool",
                       agent, log)
            agent.send_signal(signum)
            held = held_host_batches(spool, topic)
        finally:
            os.kill(broker.pid, signal.SIGCONT)
        assert agent.wait(90) == 0, log.read_text()[-3000:]
        # every host batch held during the outage reached the topic
        got = read_batches(broker.bootstrap, topic, 1, want_rows=10**9, timeout_s=10)[0]
        assert all(b.host == "node-stop" for b in got)
        assert held <= {b.batch_id for b in got}, f"held {sorted(held)}, delivered {sorted(b.batch_id for b in got)}"
        assert list(spool.glob("*.msg")) == []  # nothing left behind: all of it was delivered
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        broker.stop()


def _memory_only_agent(tmp_path, broker, flush_timeout_s: float, extra_env: dict):
    env = {**os.environ, "FLEETSCOPE_KAFKA": broker.bootstrap, "FLEETSCOPE_TOPIC_PREFIX": PREFIX,
           "FLEETSCOPE_PARTITIONS": "1", "FLEETSCOPE_DATA_DIR": str(tmp_path), "FLEETSCOPE_HOST": "node-stop",
           "FLEETSCOPE_NVML": "false", "FLEETSCOPE_PROC_SAMPLING": "false", "FLEETSCOPE_TRACE": "",
           "FLEETSCOPE_COLLECTORS": "meminfo", "FLEETSCOPE_SAMPLE_INTERVAL_S": "0.2",
           "FLEETSCOPE_STOP_FLUSH_TIMEOUT_S": str(flush_timeout_s), **extra_env}
    env.pop("FLEETSCOPE_SPOOL_DIR", None)
    log = tmp_path / "agent.log"
    agent = subprocess.Popen([sys.executable, "-m", "fleetscope", "agent"], env=env, stdout=open(log, "wb"),
                             stderr=subprocess.STDOUT)
    wait_until(lambda: read_batches(broker.bootstrap, f"{PREFIX}.raw.host", 1, want_rows=1, timeout_s=1)[0], 60,
               "the agent's first host batch", agent, log)
    return agent, log


@contextlib.contextmanager
def frozen(broker):
    """An outage: the broker is stopped (SIGSTOP) inside the block, and answers again after it."""
    os.kill(broker.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(broker.pid, signal.SIGCONT)


@pytest.fixture
def stop_stack(tmp_path):
    """A broker, and the memory-only agent started against it by stop_stack.start(flush timeout, **settings)."""
    broker = EmbeddedBroker(port=free_port(), log_path=tmp_path / "broker.log").start()
    started = []

    def start(flush_timeout_s: float, **extra_env):
        started.append(_memory_only_agent(tmp_path, broker, flush_timeout_s, extra_env))
        return started[-1]
    yield broker, start
    for agent, _ in started:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    broker.stop()


@pytest.mark.integration
def test_without_a_spool_directory_a_stop_still_flushes_what_memory_holds(stop_stack):
    """The memory-only spool (the default): batches sampled while the broker is frozen reach it after SIGTERM."""
    broker, start = stop_stack
    agent, log = start(60)
    frozen_ns = time.time_ns()
    with frozen(broker):
        time.sleep(2.5)  # batches held in memory (host rows go out about once a second)
        agent.send_signal(signal.SIGTERM)
        time.sleep(0.5)
    assert agent.wait(90) == 0, log.read_text()[-3000:]
    got = read_batches(broker.bootstrap, f"{PREFIX}.raw.host", 1, want_rows=10**9, timeout_s=10)[0]
    held = [b for b in got if b.created_ns >= frozen_ns]
    assert len(held) >= 2, (len(got), len(held))
    assert "undelivered" not in log.read_text()  # none dropped at the stop (the warning counts them)


@pytest.mark.integration
def test_a_stop_whose_broker_never_answers_ends_at_the_flush_timeout_and_says_what_it_lost(stop_stack):
    broker, start = stop_stack
    agent, log = start(3)
    with frozen(broker):
        time.sleep(1.0)
        agent.send_signal(signal.SIGTERM)
        # bounded by the 3 s flush (and the process's own start-up and shutdown, slower on a busy machine),
        # never by the broker, which stays frozen until the agent has gone
        assert agent.wait(45) == 0, log.read_text()[-3000:]
    assert "still undelivered after 3 s at agent stop" in log.read_text(), log.read_text()[-3000:]


@pytest.mark.integration
def test_batches_the_spool_overflows_in_an_outage_are_counted_in_the_agents_published_health_events(stop_stack):
    """The spool holds 3 batches; a 3 s outage at 5 ticks a second (a host and an agent batch each) overflows it.
    What was dropped is not only counted in the process: the agent's own `agent` events say so on the topic."""
    broker, start = stop_stack
    agent, log = start(60, FLEETSCOPE_SPOOL_MAX_BATCHES="3")
    with frozen(broker):
        time.sleep(3.0)
    topic = f"{PREFIX}.raw.agent"

    def published_drops() -> dict:
        last = {}
        for batch in read_batches(broker.bootstrap, topic, 1, want_rows=10**9, timeout_s=2)[0]:
            last.update({r["metric"]: r["value"] for r in rows(batch) if r["metric"].startswith("agent.dropped")})
        return last

    wait_until(lambda: published_drops().get("agent.dropped_overflow_batches", 0) > 0, 60,
               "an agent event that counts the overflow", agent, log)
    drops = published_drops()
    assert drops["agent.dropped_batches"] >= drops["agent.dropped_overflow_batches"] > 0, drops
    assert drops["agent.dropped_events"] > 0, drops
    assert "the spool is full" in log.read_text()  # and the agent's log says what it dropped
