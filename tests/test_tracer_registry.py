"""The tracer registry: one line per tracer, from which the manager's classes and options come, and which
agrees with the names the core keeps (config.TRACE_FAMILIES, schema.TRACED_SOURCES)."""
from __future__ import annotations

import dataclasses
import inspect
import os

import pytest

from fleetscope.config import TRACE_FAMILIES, Config
from fleetscope.producers.tracers.registry import TRACED_SOURCES, TRACERS, tracer_class, tracer_options
from fleetscope.schema import SOURCE_COLUMNS, TRACED_SOURCES as SCHEMA_TRACED_SOURCES


def test_the_core_lists_agree_with_the_registry():
    assert tuple(TRACERS) == TRACE_FAMILIES == Config().trace
    assert TRACED_SOURCES == SCHEMA_TRACED_SOURCES
    for name in TRACERS:
        assert name in SOURCE_COLUMNS  # a tracer publishes the source it is named after
        assert ("sample_frac" in SOURCE_COLUMNS[name]) == TRACERS[name].sample_frac


def test_every_tracer_class_loads_and_names_its_source():
    for name in TRACERS:
        cls = tracer_class(name)
        source = getattr(cls, "source", None) or getattr(cls, "SOURCE", None)
        assert source in (name, None), (name, source)  # the kernel tracer has no uprobe source attribute
        assert name == "kernel" or source == name


def test_every_option_is_a_config_field_and_a_constructor_keyword():
    config_fields = {f.name for f in dataclasses.fields(Config)}
    for name, entry in TRACERS.items():
        params = inspect.signature(tracer_class(name).__init__).parameters
        for kw, cfg_field in entry.options.items():
            assert cfg_field in config_fields, (name, cfg_field)
            assert kw in params, (name, kw)


def test_trace_python_prefixes_reach_the_python_tracer_options():
    """Issue 19: the manager passed options only when named in a class attribute OPTIONS that no tracer
    defined, so the prefixes never arrived."""
    cfg = Config(trace_python_prefixes=("/srv/job/",))
    assert tracer_options("python", cfg)["prefixes"] == ("/srv/job/",)


@pytest.mark.skipif(os.geteuid() != 0, reason="loading BPF programs needs root (CI runs as root)")
@pytest.mark.root
def test_the_manager_builds_the_python_tracer_with_the_configured_prefixes():
    from fleetscope.producers.tracers.manager import TracerManager
    cfg = Config(trace=("python",), trace_python_prefixes=("/srv/job/",), trace_auto=False)
    manager = TracerManager(cfg, hit_cost_ns=6000.0)
    try:
        assert manager.unavailable == {}
        assert manager.tracers["python"].prefixes == ("/srv/job/",)
    finally:
        manager.close()


def test_an_unknown_tracer_name_is_refused_with_the_known_ones():
    from fleetscope.config import ConfigError
    with pytest.raises(ConfigError, match="known: \\['kernel', 'cuda', 'nccl', 'python', 'torch', 'python_sampler'\\]"):
        Config(trace=("gpu",)).validate()
