"""The embedded fleetscope stack for one evaluation run: broker, sink, streams worker, agent.

The same launcher as `fleetscope up` (cli/launcher.py): a fresh tansu broker, one
`fleetscope sink` process that owns a fresh chDB under `data_dir` (reachable from
here through its loopback endpoint), one `fleetscope streams` worker, and the node
agent on a thread of this process. Each run gets its own data dir and topic prefix,
so runs never see each other's windows or models.

`EvalStack(cfg).start()` ... `.stop()`; stop() is idempotent and runs on any error
(use `with`). The children die with us even if we are killed (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import os
from dataclasses import replace

from fleetscope.config import Config
from fleetscope.cli.launcher import EmbeddedStack, StackError

__all__ = ["EvalStack", "StackError"]


class EvalStack(EmbeddedStack):
    def __init__(self, cfg: Config):
        # always a fresh broker of our own: a run must not share offsets or groups with anything else
        super().__init__(replace(cfg, kafka=None, embedded_broker_port=0), workers=1, agent=True)

    def start(self, timeout_s: float = 120.0) -> "EvalStack":
        super().start(timeout_s)
        return self

    def _trace_source(self):
        """The agent's `trace` source, or None when nothing traces here (tracing off, not root, not built)."""
        if not self.cfg.trace or os.geteuid() != 0:
            return None
        return next((s for s in self.agent.sources if s.name == "trace"), None)

    def tracers_ready(self) -> bool:
        """True once the agent's eBPF tracer manager runs, or tracing is off or could not start (logged)."""
        trace = self._trace_source()
        return trace is None or trace.settled

    def traced_since(self, pids) -> float | None:
        """The wall time by which the agent's every tracer had tried each of ``pids``; 0.0 when nothing traces
        them (tracing off, not root, no tracer could start), None while one has not."""
        trace = self._trace_source()
        return 0.0 if trace is None else trace.traced_since(pids)
