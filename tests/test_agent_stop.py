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
