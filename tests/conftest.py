"""Shared fixtures: the real embedded broker and the real embedded stack (sink and worker processes)."""
from __future__ import annotations

import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from fleetscope.broker import EmbeddedBroker
from fleetscope.config import Config
from fleetscope.cli.launcher import EmbeddedStack
from fleetscope.store import open_store
from fleetscope.topics import all_topics, ensure_topics


@pytest.fixture(scope="session")
def broker(tmp_path_factory):
    b = EmbeddedBroker(log_path=tmp_path_factory.mktemp("broker") / "broker.log").start()
    yield b
    b.stop()


@pytest.fixture()
def pipeline_cfg(tmp_path, broker) -> Config:
    run = uuid.uuid4().hex[:8]
    cfg = Config(data_dir=tmp_path, topic_prefix=f"t{run}", consumer_group=f"g{run}", partitions=2,
                 window_s=1.0, allowed_lateness_s=0.5, idle_close_s=3.0, host=f"host-{run}",
                 sample_interval_s=0.5, metrics_port=0,  # /metrics on a free port: tests run side by side
                 # pipeline tests count exact rows: no tracers, which would also pick up
                 # whatever torch processes other tests on this machine run (trace_auto)
                 trace=())
    ensure_topics(broker.bootstrap, all_topics(cfg), cfg.partitions)
    return cfg


@pytest.fixture()
def embedded_stack(pipeline_cfg, broker):
    """Starts the launcher's stack (cli/launcher.py: a `fleetscope sink` process and `fleetscope streams`
    worker processes, as an operator runs them) on the session's broker; every one started is stopped."""
    stacks: list[EmbeddedStack] = []

    def make(workers: int = 1, cfg: Config | None = None) -> EmbeddedStack:
        stack = EmbeddedStack(replace(cfg or pipeline_cfg, kafka=broker.bootstrap), workers=workers)
        stacks.append(stack)
        return stack.start()

    yield make
    for stack in stacks:
        stack.stop()


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
        if {"broker", "pipeline_cfg", "embedded_stack"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
