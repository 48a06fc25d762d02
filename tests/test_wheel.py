"""What a user gets from `pip install fleetscope`: one top-level package that carries its SQL, KB and BPF
sources, and commands that work from any directory, with no checkout beside them.

The fresh virtualenv takes the wheel with --no-deps; its dependencies come from the project's own virtualenv
through a .pth line (the network here reaches only package mirrors, and a full dependency install would take
minutes). A .pth line adds a folder to sys.path without running that folder's own .pth files, so the
project's editable install is not active in the fresh one: the wheel's copy is what gets imported, which the
test checks."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_every_package_in_the_tree_is_declared():
    """A package folder missing from pyproject's list would be absent from the wheel while the editable install
    still finds it: every folder with an __init__.py under the mapped roots must be declared."""
    import tomllib
    declared = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    roots = {"src/fleetscope": "fleetscope", "producers": "fleetscope.producers", "streams": "fleetscope.streams",
             "sql": "fleetscope.sql", "kb": "fleetscope.kb", "bpf": "fleetscope.bpf"}
    found = set()
    for folder, package in roots.items():
        for init in (REPO / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO / folder).parts
            found.add(".".join([package, *parts]))
    assert sorted(found - declared) == [] and sorted(declared - found) == []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # built from a copy of the working tree (what git would commit), so no build/ folder lands in the checkout
    source = tmp_path_factory.mktemp("source")
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"],
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(source)], check=True, capture_output=True, timeout=600)
    (found,) = out.glob("fleetscope-*.whl")
    return found


@pytest.mark.slow
def test_the_wheel_has_one_top_level_package_and_carries_its_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"fleetscope"}
    for must in ("fleetscope/sql/001_", "fleetscope/kb/straggler_rank.yaml", "fleetscope/bpf/events.h",
                 "fleetscope/bpf/torch.bpf.c", "fleetscope/eval/gpu_stub/cudart_stub.c",
                 "fleetscope/eval/scenarios/demo_straggler.yaml", "fleetscope/producers/agent.py",
                 "fleetscope/streams/worker.py", "fleetscope/cli/main.py"):
        assert any(n.startswith(must) for n in names), f"{must} is not in the wheel"
    assert not any(n.startswith(("tests/", "benchmarks/", "fleetscope/tests")) for n in names)


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    env_dir = tmp_path_factory.mktemp("fresh") / "venv"
    venv.create(env_dir, with_pip=False, symlinks=True)
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    return env_dir


def run_outside(installed: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE_")}
    env["FLEETSCOPE_DATA_DIR"] = str(tmp_path / "data")
    return subprocess.run([str(installed / "bin" / "fleetscope"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.integration
def test_the_installed_commands_work_outside_the_checkout(installed, tmp_path):
    where = subprocess.run([str(installed / "bin" / "python"), "-c",
                            "import fleetscope.sql, fleetscope.streams; print(fleetscope.sql.__file__); "
                            "print(fleetscope.streams.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout.split()
    assert all(str(installed) in w for w in where), f"imported from the checkout, not the wheel: {where}"
    migrate = run_outside(installed, tmp_path, "db", "migrate")
    assert migrate.returncode == 0, migrate.stderr
    assert "applied: 001" in migrate.stdout
    kb = run_outside(installed, tmp_path, "kb", "list")
    assert kb.returncode == 0, kb.stderr
    assert "straggler_rank" in kb.stdout
    demo = run_outside(installed, tmp_path, "demo", "--help")
    assert demo.returncode == 0 and "usage: fleetscope demo" in demo.stdout, demo.stderr
