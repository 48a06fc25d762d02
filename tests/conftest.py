"""Shared fixtures: the real embedded broker and real stream-worker processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from fleetscope.broker import EmbeddedBroker
from fleetscope.config import Config
from fleetscope.store import open_store
from fleetscope.store.endpoint import RemoteStore, endpoint_alive
from fleetscope.topics import all_topics, ensure_topics


@pytest.fixture(scope="session")
def broker(tmp_path_factory):
    b = EmbeddedBroker(log_path=tmp_path_factory.mktemp("broker") / "broker.log").start()
    yield b
    b.stop()


class StreamsWorker:
    """`python -m fleetscope streams` in its own process group, as an operator would run it."""

    def __init__(self, cfg: Config, bootstrap: str):
        self.cfg = cfg
        self.bootstrap = bootstrap
        self.proc: subprocess.Popen | None = None
        self.log_path = cfg.data_dir / "streams.log"

    def env(self) -> dict:
        return {**os.environ, "FLEETSCOPE_KAFKA": self.bootstrap, "FLEETSCOPE_DATA_DIR": str(self.cfg.data_dir),
                "FLEETSCOPE_TOPIC_PREFIX": self.cfg.topic_prefix, "FLEETSCOPE_CONSUMER_GROUP": self.cfg.consumer_group,
                "FLEETSCOPE_WINDOW_S": str(self.cfg.window_s),
                "FLEETSCOPE_ALLOWED_LATENESS_S": str(self.cfg.allowed_lateness_s),
                "FLEETSCOPE_IDLE_CLOSE_S": str(self.cfg.idle_close_s), "FLEETSCOPE_HOST": self.cfg.host}

    def start(self, timeout_s: float = 60) -> "StreamsWorker":
        self.proc = subprocess.Popen([sys.executable, "-m", "fleetscope", "streams"], env=self.env(),
                                     stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not endpoint_alive(self.cfg.data_dir):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"streams worker did not come up:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        return self

    def stats(self) -> dict:
        return RemoteStore(self.cfg.data_dir).stats()

    def query(self, sql: str, params: dict | None = None):
        return RemoteStore(self.cfg.data_dir).query(sql, params)

    def wait_for(self, predicate, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"worker died:\n{self.log_path.read_text()[-3000:]}"
            last = predicate()
            if last:
                return last
            time.sleep(0.25)
        raise AssertionError(f"timed out waiting for {what}; last={last}\n{self.log_path.read_text()[-2000:]}")

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        (self.cfg.data_dir / "endpoint.json").unlink(missing_ok=True)  # a killed worker cannot clean up

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.fixture()
def pipeline_cfg(tmp_path, broker) -> Config:
    run = uuid.uuid4().hex[:8]
    cfg = Config(data_dir=tmp_path, topic_prefix=f"t{run}", consumer_group=f"g{run}", partitions=2,
                 window_s=1.0, allowed_lateness_s=0.5, idle_close_s=3.0, host=f"host-{run}",
                 sample_interval_s=0.5,
                 # pipeline tests count exact rows: no tracers, which would also pick up
                 # whatever torch processes other tests on this machine run (trace_auto)
                 trace=())
    ensure_topics(broker.bootstrap, all_topics(cfg), cfg.partitions)
    return cfg


@pytest.fixture()
def streams_worker(pipeline_cfg, broker):
    workers: list[StreamsWorker] = []

    def make() -> StreamsWorker:
        w = StreamsWorker(pipeline_cfg, broker.bootstrap)
        workers.append(w)
        return w

    yield make
    for w in workers:
        w.stop()


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


@pytest.fixture()
def store(tmp_path):
    """A migrated embedded chDB store in the test's own directory (tests/test_store.py has its own)."""
    s = open_store(tmp_path, clickhouse_url=None, prefer_endpoint=False)
    s.migrate()
    yield s
    s.close()


# Markers (pyproject.toml): `-m "not slow"` for a quick pass, `-m "not root"` where eBPF and cgroups are
# unavailable. A test module that loads BPF programs or changes cgroups and /proc/irq needs root; a test that
# uses the real broker or starts worker processes is an integration test.
ROOT_MODULES = {"test_cuda_tracer", "test_nccl_tracer", "test_kernel_tracer", "test_python_tracer",
                "test_torch_tracer", "test_tracing_pipeline", "test_ebpf_toolchain", "test_governor",
                "test_return_probe_safety", "test_target_discovery", "test_eval_faults", "test_eval_runner",
                "test_gpu_standin"}
SLOW_MODULES = {"test_eval_runner", "test_wheel", "test_end_to_end"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if module in ROOT_MODULES:
            item.add_marker(pytest.mark.root)
        if module in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        if {"broker", "pipeline_cfg", "streams_worker"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
