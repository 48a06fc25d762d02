"""EmbeddedStack.stop_agent waits for the agent's whole stop (its sources close, then it flushes), so `fleetscope up`
never exits with the agent's thread inside native code: that aborted the process on a loaded machine ("pure
virtual method called", exit -6) when the wait was a fixed 15 s.

The agent here is a stand-in whose stop takes a set time (a real agent's stop time depends on the machine's
load, which a test cannot set); the stack, its config and its thread handling are the real ones.
"""
from __future__ import annotations

import logging
import threading
import time

from fleetscope.cli import launcher
from fleetscope.cli.launcher import EmbeddedStack
from fleetscope.config import Config


class SlowToStopAgent:
    def __init__(self, stop_takes_s: float):
        self.stop_takes_s, self._stop, self.finished = stop_takes_s, threading.Event(), threading.Event()

    def run(self) -> None:
        self._stop.wait()
        time.sleep(self.stop_takes_s)   # closing its sources and flushing
        self.finished.set()

    def stop(self) -> None:
        self._stop.set()


def stack_with(tmp_path, agent: SlowToStopAgent) -> EmbeddedStack:
    stack = EmbeddedStack(Config(data_dir=tmp_path, stop_flush_timeout_s=1.0))
    stack.agent = agent
    stack._agent_thread = threading.Thread(target=agent.run, daemon=True)
    stack._agent_thread.start()
    return stack


def test_the_stack_waits_for_an_agent_that_takes_longer_than_its_flush_to_stop(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "AGENT_CLOSE_GRACE_S", 3.0)
    agent = SlowToStopAgent(stop_takes_s=2.0)   # over the 1 s flush, within flush + grace
    stack = stack_with(tmp_path, agent)
    stack.stop_agent()
    assert agent.finished.is_set() and not stack.agent_still_running()


def test_an_agent_that_never_stops_is_reported_not_waited_for_forever(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(launcher, "AGENT_CLOSE_GRACE_S", 0.5)
    agent = SlowToStopAgent(stop_takes_s=30.0)
    stack = stack_with(tmp_path, agent)
    with caplog.at_level(logging.WARNING, logger=launcher.__name__):
        stack.stop_agent()
    assert stack.agent_still_running() and not agent.finished.is_set()
    assert "did not stop within 2 s" in caplog.text
