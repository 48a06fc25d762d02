"""The agent's `trace` source says when it has settled, and the evaluation stack waits for exactly that.

The eval runner used to look for a `samplers` attribute the agent no longer has, so every
scenario waited its full 240 s for "the eBPF tracers" and then went on without knowing.
"""
import threading
from dataclasses import replace
from types import SimpleNamespace

from fleetscope.config import Config
from fleetscope.eval.stack import EvalStack
from fleetscope.producers.tracing_source import TracingSource


class FakeManager:  # stands for a compiled TracerManager: building a real one needs BPF programs per tracer
    def __init__(self):
        self.started = self.closed = False

    def start(self):
        self.started = True

    def close(self):
        self.closed = True


def settle(source: TracingSource) -> None:
    source._thread.join(10)


def test_a_source_whose_manager_started_is_settled():
    release = threading.Event()
    manager = FakeManager()
    source = TracingSource(lambda: release.wait(10) and manager)
    assert not source.settled  # not started yet
    source.start()
    assert not source.settled  # compiling
    release.set()
    settle(source)
    assert source.settled and source.manager is manager and manager.started


def test_a_source_that_could_not_start_a_manager_is_settled_without_one():
    source = TracingSource(lambda: None).start()
    settle(source)
    assert source.settled and source.manager is None


def stack_with_sources(sources, trace="cuda") -> EvalStack:
    stack = EvalStack.__new__(EvalStack)  # only what tracers_ready reads: no broker or worker is started
    stack.cfg = replace(Config(), trace=trace)
    stack.agent = SimpleNamespace(sources=sources)
    return stack


def test_the_eval_stack_waits_for_the_trace_source_of_its_agent(monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 0)
    release = threading.Event()
    source = TracingSource(lambda: release.wait(10) and FakeManager()).start()
    stack = stack_with_sources([SimpleNamespace(name="host"), source])
    assert not stack.tracers_ready()
    release.set()
    settle(source)
    assert stack.tracers_ready()
    assert stack_with_sources([SimpleNamespace(name="host")]).tracers_ready()  # tracing not built: nothing to wait for
    assert stack_with_sources([source], trace="").tracers_ready()
