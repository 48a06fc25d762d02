"""A stand-in tracer for the tracer manager's tests, which pin the manager's bookkeeping of attempts (when a
process counts as tried, when it is tried again), not a probe; and a real process for it to be given."""
from __future__ import annotations

import subprocess
import sys

import pytest

from fleetscope.config import Config
from fleetscope.producers.tracers.manager import TracerManager


class StandInTracer:
    """add_pid answers what the test sets: True (attached), False (library not mapped yet) or raises; a list
    gives one answer per try, its last one from then on. Counts tries and removals."""

    def __init__(self, answer=True):
        self.answers = list(answer) if isinstance(answer, list) else [answer]
        self.tries = self.removed = 0

    def families(self):
        return {}

    def add_pid(self, pid):
        self.tries += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def remove_pid(self, pid):
        self.removed += 1

    def sample(self, now_ns):
        return None

    def close(self):
        pass


@pytest.fixture
def rank():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def manager_for(pid: int, poll_s: float = 1.0, **tracers) -> TracerManager:
    return TracerManager(Config(trace_pids=(str(pid),), trace_auto=False, trace_poll_s=poll_s), tracers=tracers,
                         hit_cost_ns=6000.0)
