"""The embedded stack, started and stopped in one place: `fleetscope up`, the tests, the
evaluation harness and the benchmarks all use this.

Parts, started in this order:
1. the tansu broker, unless `cfg.kafka` names a Kafka;
2. the topics;
3. one `fleetscope sink` process: it owns the store (chDB allows one process per data
   directory), applies the migrations and serves the loopback endpoint (queries, its
   counters); the stack waits for that endpoint;
4. N `fleetscope streams` worker processes (one consumer group): they compute and publish,
   and write their counters to <data_dir>/workers/<pid>.json;
5. optionally the node agent, on a thread of this process.

Every child gets the stack's whole config as one TOML file (<data_dir>/stack.toml, 0600;
setting variables are dropped from its environment so they cannot override it, secrets
stay), runs in its own process group, and dies with us even if we are killed
(PR_SET_PDEATHSIG). stop() goes in the order that loses nothing: the agent flushes, the
workers publish what they hold, the sink stores it, then the broker goes.
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
from dataclasses import fields, replace
from pathlib import Path
from typing import Callable

from fleetscope.broker import EmbeddedBroker, private_child
from fleetscope.private_files import open_private_append, private_dir
from fleetscope.config import SETTING_ENV_VARS, Config
from fleetscope.store.endpoint import ENDPOINT_FILE, RemoteStore, read_endpoint
from fleetscope.store.base import StoreError
from fleetscope.topics import RAW_SOURCES, prepare_topics
from fleetscope.streams.sink.consumer import sink_topics
from fleetscope.streams.stats_file import read_worker_stats, worker_stats_path

CONFIG_FILE = "stack.toml"
AGENT_CLOSE_GRACE_S = 30.0  # beyond its flush: the agent's tracers detach and its samplers close
log = logging.getLogger(__name__)
CLEAN_EXITS = (0, -signal.SIGTERM)


class StackError(RuntimeError):
    """A part of the stack did not start or died; the message names it and its log."""


def config_toml(cfg: Config) -> str:
    """Every setting of `cfg` as TOML that fleetscope.config.load reads back to the same Config."""
    lines = []
    for f in fields(Config):
        v = getattr(cfg, f.name)
        if v is None:
            continue  # None is every optional setting's default
        lines.append(f"{f.name} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v), ensure_ascii=False)  # JSON's string escapes are TOML's basic-string escapes


class ChildProcess:
    """One `python -m fleetscope <command>` in its own process group, its output appended to a log."""

    def __init__(self, name: str, argv: list[str], env: dict, log_path: Path):
        self.name, self.argv, self.env, self.log_path = name, argv, env, log_path
        self.proc: subprocess.Popen | None = None
        self.killed = False  # on purpose (a fault test): not a death the stack reports

    def start(self) -> "ChildProcess":
        with open_private_append(self.log_path) as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, preexec_fn=private_child)
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def kill(self) -> None:
        """SIGKILL, as a crash: no flush, no commit, no goodbye."""
        if self.alive():
            self.killed = True
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def stop(self, timeout_s: float = 30.0) -> None:
        if not self.alive():
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        except ProcessLookupError:
            self.proc.wait()

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"


def _summed(docs: list[dict]) -> dict:
    """Workers' counters as one: counts and gauges add up; times (…_ns, …_s) take the latest or worst."""
    out: dict = {}
    for d in docs:
        for k, v in d.items():
            if k in ("pid", "written_at_ns") or not isinstance(v, (int, float)):
                continue
            if isinstance(v, bool):
                out[k] = out.get(k, False) or v
            elif k.endswith(("_ns", "_s")):
                out[k] = max(out.get(k, v), v)
            else:
                out[k] = out.get(k, 0) + v
    return out


class EmbeddedStack:
    def __init__(self, cfg: Config, workers: int = 1, agent: bool = False,
                 worker_argv: list[str] | None = None, env: dict | None = None):
        """`worker_argv` replaces `python -m fleetscope streams` (a benchmark's profiled worker);
        `env` replaces os.environ as the base of the children's environment."""
        if workers < 1:
            raise ValueError("an embedded stack needs at least one worker")
        self.cfg = cfg
        self.n_workers = workers
        self.with_agent = agent
        self.worker_argv = worker_argv or [sys.executable, "-m", "fleetscope", "streams"]
        self.base_env = dict(os.environ if env is None else env)
        self.broker: EmbeddedBroker | None = None
        self.sink: ChildProcess | None = None
        self.workers: list[ChildProcess] = []
        self.agent = None
        self._agent_thread: threading.Thread | None = None
        self._lag_consumers: dict = {}

    @property
    def data_dir(self) -> Path:
        return Path(self.cfg.data_dir)

    @property
    def bootstrap(self) -> str | None:
        return self.cfg.kafka

    # -- start ---------------------------------------------------------------------------------------------

    def start(self, timeout_s: float = 120.0) -> "EmbeddedStack":
        try:
            private_dir(self.data_dir)  # also one an older version made 0755
            if not self.cfg.kafka:
                self.broker = EmbeddedBroker(self.cfg.embedded_broker_port,
                                             log_path=self.data_dir / "broker.log").start()
                self.cfg = replace(self.cfg, kafka=self.broker.bootstrap)
            prepare_topics(self.cfg, self.cfg.kafka)
            self._write_config()
            self.start_sink(timeout_s)
            for i in range(self.n_workers):
                self.workers.append(self._new_worker(i))
            for i in range(self.n_workers):
                self.start_worker(i, timeout_s)
            if self.with_agent:
                self.start_agent()
        except BaseException:
            self.stop()
            raise
        return self

    def _write_config(self) -> None:
        path = self.data_dir / CONFIG_FILE
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(config_toml(self.cfg))

    def child_env(self) -> dict:
        env = {k: v for k, v in self.base_env.items() if k not in SETTING_ENV_VARS and k != "FLEETSCOPE_CONFIG"}
        env["FLEETSCOPE_CONFIG"] = str(self.data_dir / CONFIG_FILE)
        return env

    def start_sink(self, timeout_s: float = 120.0) -> ChildProcess:
        (self.data_dir / ENDPOINT_FILE).unlink(missing_ok=True)  # a killed sink's, if any
        self.sink = ChildProcess("sink", [sys.executable, "-m", "fleetscope", "sink"], self.child_env(),
                                 self.data_dir / "sink.log").start()
        self.wait_for(self._sink_serving, timeout_s, "the sink's endpoint")
        return self.sink

    def _sink_serving(self) -> bool:
        doc = read_endpoint(self.data_dir)
        if doc is None or int(doc["pid"]) != self.sink.pid:
            return False
        try:
            RemoteStore(self.data_dir, timeout=5).stats()
            return True
        except StoreError:
            return False

    def _new_worker(self, i: int) -> ChildProcess:
        return ChildProcess(f"worker {i}", list(self.worker_argv), self.child_env(),
                            self.data_dir / ("streams.log" if i == 0 else f"streams-{i}.log"))

    def start_worker(self, i: int, timeout_s: float = 120.0) -> ChildProcess:
        w = self.workers[i]
        if w.alive():
            raise StackError(f"{w.name} is already running (pid {w.pid})")
        if w.proc is not None:
            w = self.workers[i] = self._new_worker(i)
        w.start()
        self.wait_for(lambda: read_worker_stats(self.data_dir, w.pid) is not None, timeout_s, f"{w.name}'s counters")
        return w

    def start_agent(self) -> None:
        from fleetscope.producers.agent import build_agent
        self.agent = build_agent(self.cfg, self.cfg.kafka)
        self._agent_thread = threading.Thread(target=self.agent.run, name="fleetscope-agent", daemon=True)
        self._agent_thread.start()

    # -- faults --------------------------------------------------------------------------------------------

    def kill_worker(self, i: int = 0) -> None:
        w = self.workers[i]
        w.kill()
        worker_stats_path(self.data_dir, w.pid).unlink(missing_ok=True)  # a killed worker cannot clean up

    def restart_worker(self, i: int = 0, timeout_s: float = 120.0) -> ChildProcess:
        return self.start_worker(i, timeout_s)

    def kill_sink(self) -> None:
        self.sink.kill()
        (self.data_dir / ENDPOINT_FILE).unlink(missing_ok=True)  # a killed sink cannot clean up

    def restart_sink(self, timeout_s: float = 120.0) -> ChildProcess:
        if self.sink is not None and self.sink.alive():
            raise StackError(f"the sink is already running (pid {self.sink.pid})")
        return self.start_sink(timeout_s)

    def add_worker(self, timeout_s: float = 120.0) -> int:
        """Start one more worker in the group (a scale-out); returns its index."""
        self.workers.append(self._new_worker(len(self.workers)))
        self.start_worker(len(self.workers) - 1, timeout_s)
        return len(self.workers) - 1

    def retire_worker(self, i: int) -> None:
        """Stop a worker as an operator scales in (SIGTERM: it publishes what it holds and leaves the group)."""
        w = self.workers[i]
        w.killed = True  # on purpose: not a death check() reports
        w.stop()

    def _pid_of(self, part: str) -> int:
        if part == "broker":
            if self.broker is None or self.broker.pid is None:
                raise StackError("this stack did not start the broker (cfg.kafka names one)")
            return self.broker.pid
        child = self.sink if part == "sink" else self.workers[int(part.removeprefix("worker "))]
        if child is None or not child.alive():
            raise StackError(f"the {part} is not running")
        return child.pid

    def pause(self, part: str) -> None:
        """SIGSTOP "broker", "sink" or "worker <i>": frozen with its sockets open, as a hung host or a partition
        (tansu keeps its topics in memory, so a stopped-and-restarted broker would lose them: pause, not restart)."""
        os.kill(self._pid_of(part), signal.SIGSTOP)

    def resume(self, part: str) -> None:
        os.kill(self._pid_of(part), signal.SIGCONT)

    # -- looking at it -------------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise StackError if a part that should run has exited."""
        for part in [self.sink, *self.workers]:
            if part is not None and part.proc is not None and not part.killed and not part.alive():
                raise StackError(f"the {part.name} (pid {part.pid}) exited with code {part.returncode}; "
                                 f"see {part.log_path}")

    def worker_stats(self) -> dict | None:
        """The live workers' counters summed (events_in, windows_out, dlq, model_*, open_windows, ...);
        None until every live worker has written its first."""
        docs = [read_worker_stats(self.data_dir, w.pid) for w in self.workers if w.alive()]
        if not docs or any(d is None for d in docs):
            return None
        return _summed(docs)

    def sink_stats(self) -> dict | None:
        """The sink's counters (sink_raw_rows, sink_derived_rows, sink_dlq_rows, sink_paused, ...)."""
        try:
            return RemoteStore(self.data_dir, timeout=5).stats()
        except StoreError:
            return None

    def stats(self) -> dict | None:
        """The workers' counters and the sink's (its keys start with `sink_`), or None while either is missing."""
        w, s = self.worker_stats(), self.sink_stats()
        return None if w is None or s is None else {**w, **s}

    def query(self, sql: str, params: dict | None = None, attempts: int = 5):
        """SQL through the sink's endpoint (it holds the store); a slow answer on a loaded machine is retried."""
        for attempt in range(attempts):
            try:
                return RemoteStore(self.data_dir, timeout=60).query(sql, params or {})
            except StoreError:
                self.check()
                if attempt == attempts - 1:
                    raise
                time.sleep(1.0 + attempt)

    def lag(self, group: str, topics: list[str]) -> int | None:
        """Messages not yet committed by `group` on `topics`, summed over partitions; None if Kafka did not say.
        The probe never joins the group (it only reads committed offsets), so it moves no partition. The ends are
        read, not taken from the broker's report, which on tansu stops short of the last batch (topic_reader)."""
        from confluent_kafka import TopicPartition

        from fleetscope.topic_reader import committed_and_ends
        consumer = self._probe_consumer(group)
        try:
            meta = consumer.list_topics(timeout=2.0)
            tps = [TopicPartition(t, p) for t in topics if t in meta.topics for p in meta.topics[t].partitions]
            # max(0, ...): a commit past the end just read (the partition grew in between) is no lag
            return sum(max(0, end - (committed if committed >= 0 else low))
                       for _, committed, low, end in committed_and_ends(consumer, self._probe_consumer(None), tps))
        except Exception:  # best effort: a status probe must never take the stack down
            return None

    def _probe_consumer(self, group: str | None):
        """One consumer per group, kept: `group` None is the end reader's, of a group it never commits to."""
        from confluent_kafka import Consumer
        key = group or ""
        consumer = self._lag_consumers.get(key)
        if consumer is None:
            from fleetscope.kafka_settings import client_conf
            consumer = self._lag_consumers[key] = Consumer(client_conf(
                self.cfg, self.cfg.kafka, **{"group.id": group or f"fleetscope-end-reader-{os.getpid()}",
                                             "enable.auto.commit": False, "fetch.wait.max.ms": 10,
                                             "client.id": "fleetscope-lag-probe"}))
        return consumer

    def worker_lag(self) -> int | None:
        return self.lag(self.cfg.consumer_group, [self.cfg.raw_topic(s) for s in RAW_SOURCES])

    def sink_lag(self) -> int | None:
        return self.lag(f"{self.cfg.consumer_group}-sink", sink_topics(self.cfg))

    def wait_for(self, cond: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.25):
        """Poll `cond` until it returns something true (returned), a part dies, or the time runs out."""
        deadline = time.monotonic() + timeout_s
        last = None
        while True:
            self.check()
            last = cond()
            if last:
                return last
            if time.monotonic() > deadline:
                raise StackError(f"timed out after {timeout_s:.0f} s waiting for {what} (last: {last!r}); "
                                 f"logs in {self.data_dir}")
            time.sleep(poll_s)

    # -- stop ----------------------------------------------------------------------------------------------

    def stop_agent(self, timeout_s: float | None = None) -> None:
        """Stop the agent and wait for its thread: it closes its sources (tracers detach their probes), then
        flushes for at most stop_flush_timeout_s. Waited for in full by default: a thread left running into the
        interpreter's exit runs native code (librdkafka, Arrow) that exit is tearing down, and the process
        aborts ("pure virtual method called", measured on a loaded machine when this waited 15 s)."""
        if self.agent is not None:
            self.agent.stop()
            if self._agent_thread is not None:
                wait_s = timeout_s if timeout_s is not None else self.cfg.stop_flush_timeout_s + AGENT_CLOSE_GRACE_S
                self._agent_thread.join(wait_s)
                if self._agent_thread.is_alive():
                    log.warning("the agent did not stop within %.0f s; going on without it", wait_s)
            self.agent = None

    def agent_still_running(self) -> bool:
        """After stop(): the agent's thread outlived its wait (see stop_agent)."""
        return self._agent_thread is not None and self._agent_thread.is_alive()

    def stop(self) -> None:
        """Agent (flushes), workers (publish what they hold), sink (stores it), broker. Idempotent."""
        self.stop_agent()
        for consumer in self._lag_consumers.values():
            consumer.close()
        self._lag_consumers.clear()
        for w in self.workers:
            w.stop()
        if self.sink is not None:
            self.sink.stop()
        if self.broker is not None:
            self.broker.stop()
            self.broker = None

    def exited_cleanly(self) -> bool:
        """After stop(): every child ended on our SIGTERM (or by itself with 0)."""
        return all(p.returncode in CLEAN_EXITS for p in [self.sink, *self.workers]
                   if p is not None and p.proc is not None and not p.killed)

    def __enter__(self) -> "EmbeddedStack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
