"""Stopping the agent delivers what it holds: a real `fleetscope agent` process, a real broker, real signals.

The agent holds batches while its broker is down; the test sees them as files
in the agent's spool directory, signals the agent, brings the broker back, and
checks that the agent exits 0 only after those batches reached the topic.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from fleetscope.broker import EmbeddedBroker, free_port
from fleetscope.topics import ensure_topics
from support.raw_topic import read_batches

PREFIX = "stopflush"


def wait_until(condition, timeout_s: float, what: str, proc=None, log=None):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"agent exited early ({proc.returncode}) waiting for {what}:\n{log.read_text()[-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


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
        broker.stop()  # an outage: what the agent samples now, it holds
        wait_until(lambda: len(list(spool.glob("*.msg"))) >= 4, 60, "held batches in the spool", agent, log)
        agent.send_signal(signum)
        broker = EmbeddedBroker(port=port, log_path=tmp_path / "broker.log").start()  # Kafka comes back
        ensure_topics(broker.bootstrap, [topic, f"{PREFIX}.raw.agent"], 1)
        assert agent.wait(90) == 0, log.read_text()[-3000:]
        # the held host batches of the outage reached the (restarted, so empty before) topic
        got = read_batches(broker.bootstrap, topic, 1, want_rows=1, timeout_s=10)[0]
        assert len(got) >= 1 and all(b.host == "node-stop" for b in got)
        assert list(spool.glob("*.msg")) == []  # nothing left behind: all of it was delivered
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        broker.stop()
