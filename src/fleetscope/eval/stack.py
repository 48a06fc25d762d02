"""The embedded fleetscope stack for one evaluation run: broker, streams worker, agent.

Built from `fleetscope up`'s parts (fleetscope/up.py): a fresh tansu broker, one
`fleetscope streams` child process that owns a fresh chDB under `data_dir` (reachable
from here through its loopback endpoint), and the node agent on a thread of this
process. Each run gets its own data dir and topic prefix, so runs never see each
other's windows or models.

`EvalStack(cfg).start()` ... `.stop()`; stop() is idempotent and runs on any error
(use `with`). The worker dies with us even if we are killed (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import fields, replace
from pathlib import Path

from fleetscope.broker import EmbeddedBroker, die_with_parent
from fleetscope.config import Config
from fleetscope.topics import all_topics, ensure_topics
from fleetscope.cli.up import fetch_stats

# Settings the worker must share with us; written to its TOML config file.
WORKER_SETTINGS = ("topic_prefix", "partitions", "database", "window_s", "allowed_lateness_s", "idle_close_s",
                   "consumer_group", "step_hold_s", "warmup_windows", "detect_rule", "model_checkpoint_s", "host")


class StackError(RuntimeError):
    """A part of the stack did not start or died; the message names it and its log."""


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_worker_config(cfg: Config, path: Path) -> Path:
    known = {f.name for f in fields(Config)}
    lines = [f"{k} = {_toml_value(getattr(cfg, k))}" for k in WORKER_SETTINGS if k in known]
    path.write_text("\n".join(lines) + "\n")
    return path


class EvalStack:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.broker: EmbeddedBroker | None = None
        self.worker: subprocess.Popen | None = None
        self.agent = None
        self._agent_thread: threading.Thread | None = None
        self.bootstrap: str | None = None

    @property
    def data_dir(self) -> Path:
        return Path(self.cfg.data_dir)

    def start(self, timeout_s: float = 60.0) -> "EvalStack":
        from fleetscope.producers.agent import build_agent
        self.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.broker = EmbeddedBroker(0, log_path=self.data_dir / "broker.log").start()
            self.bootstrap = self.broker.bootstrap
            cfg = self.cfg = replace(self.cfg, kafka=self.bootstrap)
            ensure_topics(self.bootstrap, all_topics(cfg), cfg.partitions)
            conf = write_worker_config(cfg, self.data_dir / "worker.toml")
            log = open(self.data_dir / "streams.log", "ab")
            env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE_")}
            env.update(FLEETSCOPE_CONFIG=str(conf), FLEETSCOPE_KAFKA=self.bootstrap,
                       FLEETSCOPE_DATA_DIR=str(self.data_dir))
            self.worker = subprocess.Popen([sys.executable, "-m", "fleetscope", "streams"], env=env,
                                           stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
            log.close()
            self.agent = build_agent(cfg, self.bootstrap)
            self._agent_thread = threading.Thread(target=self.agent.run, name="eval-agent", daemon=True)
            self._agent_thread.start()
            self.wait_for(lambda: self.stats() is not None, timeout_s, "the streams worker's endpoint")
        except BaseException:
            self.stop()
            raise
        return self

    def check(self) -> None:
        if self.worker is not None and self.worker.poll() is not None:
            raise StackError(f"the streams worker exited with code {self.worker.returncode}; "
                             f"see {self.data_dir / 'streams.log'}")

    def stats(self) -> dict | None:
        return fetch_stats(self.data_dir)

    def tracers_ready(self) -> bool:
        """True once the agent's eBPF tracer manager has joined its samplers (or tracing is off)."""
        if not self.cfg.trace or os.geteuid() != 0:
            return True
        return any(type(s).__name__ == "TracerManager" for s in getattr(self.agent, "samplers", []))

    def wait_for(self, cond, timeout_s: float, what: str, poll_s: float = 0.5) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            self.check()
            if time.monotonic() > deadline:
                raise StackError(f"timed out after {timeout_s:.0f} s waiting for {what}; "
                                 f"logs in {self.data_dir}")
            time.sleep(poll_s)

    def query(self, sql: str, params: dict | None = None, attempts: int = 5):
        """SQL through the worker's endpoint. Never opens chDB here (the worker holds it); a
        slow answer on a loaded machine is retried, and the last error is raised."""
        from fleetscope.store import RemoteStore, StoreError
        for attempt in range(attempts):
            try:
                return RemoteStore(self.data_dir).query(sql, params or {})
            except StoreError:
                self.check()
                if attempt == attempts - 1:
                    raise
                time.sleep(1.0 + attempt)

    def stop(self) -> None:
        """Agent (flushes), then worker (commits what it stored), then broker."""
        if self.agent is not None:
            self.agent.stop()
            if self._agent_thread is not None:
                self._agent_thread.join(15)
            self.agent = None
        if self.worker is not None:
            if self.worker.poll() is None:
                self.worker.send_signal(signal.SIGTERM)
                try:
                    self.worker.wait(30)
                except subprocess.TimeoutExpired:
                    self.worker.kill()
                    self.worker.wait()
            self.worker = None
        if self.broker is not None:
            self.broker.stop()
            self.broker = None

    def __enter__(self) -> "EvalStack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
