"""The NVML stand-in (fleetscope.eval.gpu_stub/fake_nvml.c, built with gcc) for tests of NVML consumers: this
machine has no GPU and no NVML. A scenario file says what the fake GPUs report (FAKE_NVML_SCENARIO)."""
from __future__ import annotations

import shutil
import subprocess

import pynvml
import pytest

from fleetscope.resources import package_dir


@pytest.fixture(scope="session")
def stub_lib(tmp_path_factory) -> str:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the NVML stand-in library (fake_nvml.c); install gcc")
    out = tmp_path_factory.mktemp("nvml_stub") / "libnvidia-ml.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(out),
                    str(package_dir("fleetscope.eval.gpu_stub") / "fake_nvml.c")], check=True)
    yield str(out)
    # Leave pynvml as we found it, so later tests that load the system library are not handed the stub.
    with pynvml.libLoadLock:
        pynvml.nvmlLib = None
        pynvml._nvmlGetFunctionPointer_cache.clear()


@pytest.fixture
def nvml_scenario(tmp_path, monkeypatch):
    """nvml_scenario(text): the fake GPUs report what `text` says (see fake_nvml.c for its lines)."""
    def write(text: str) -> None:
        path = tmp_path / "nvml_scenario.txt"
        path.write_text(text)
        monkeypatch.setenv("FAKE_NVML_SCENARIO", str(path))
    return write
