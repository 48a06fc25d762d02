"""The CLI and its documentation agree with the code: every argument has help text, global options work on
either side of the subcommand, --version answers, and the README's configuration table is the config's fields
with their environment variables and defaults."""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import MISSING, fields
from pathlib import Path

from fleetscope import config as config_mod
from fleetscope.cli.global_options import subcommand_parsers, version
from fleetscope.cli.main import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_argument_of_every_command_has_help_text():
    parser = build_parser()
    missing = []
    for p in [parser, *subcommand_parsers(parser)]:
        for action in p._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not action.help:  # argparse.SUPPRESS (a hidden internal option) is a deliberate choice
                missing.append(f"{p.prog}: {action.option_strings or action.dest}")
    assert missing == []


def test_global_options_work_before_and_after_the_subcommand(tmp_path):
    parser = build_parser()
    before = parser.parse_args(["-v", "--config", "a.toml", "kb", "list"])
    after = parser.parse_args(["kb", "list", "-v", "--config", "a.toml"])
    neither = parser.parse_args(["kb", "list"])
    assert (before.verbose, before.config) == (after.verbose, after.config) == (True, "a.toml")
    assert (neither.verbose, neither.config) == (False, None)
    # a value given before the subcommand is not reset by the subcommand's own copy of the option
    assert parser.parse_args(["--config", "b.toml", "db", "migrate"]).config == "b.toml"


def test_version_prints_the_installed_version():
    out = subprocess.run([sys.executable, "-m", "fleetscope", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"fleetscope {version()}"
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", version())


# ---- the README's configuration table ------------------------------------------------------------------------

def readme_config_rows() -> dict[str, tuple[str, str]]:
    """TOML key -> (environment cell, default cell) of the README's configuration table."""
    text = README.read_text()
    start = text.index("| setting (TOML key) | environment | default | meaning |")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        for key in re.findall(r"`([a-z0-9_]+)`", cells[0]):
            rows[key] = (cells[1], cells[2])
    return rows


def documented_default(value) -> str | None:
    """How the README writes a literal default, or None when the table explains it in words."""
    if value is None or isinstance(value, Path):
        return None
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ", ".join(value) if value else None
    return str(value)


def test_the_readme_configuration_table_is_the_configs_fields_and_defaults():
    rows = readme_config_rows()
    env_of = {name: var for var, name in config_mod._ENV.items()}
    names = [f.name for f in fields(config_mod.Config)]
    assert sorted(set(names) - set(rows)) == [], "settings missing from the README's configuration table"
    assert sorted(set(rows) - set(names)) == [], "the README documents settings that do not exist"
    wrong = []
    for f in fields(config_mod.Config):
        env_cell, default_cell = rows[f.name]
        if f.name in env_of and env_of[f.name] not in env_cell:
            wrong.append(f"{f.name}: environment should name {env_of[f.name]}, README says {env_cell!r}")
        if f.default is MISSING:
            continue
        if isinstance(f.default, (int, float)) and not isinstance(f.default, bool):
            numbers = [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", default_cell.replace(",", ""))]
            if float(f.default) not in numbers:
                wrong.append(f"{f.name}: default is {f.default}, README says {default_cell!r}")
            continue
        want = documented_default(f.default)
        if want is not None and want.replace(" ", "") not in default_cell.replace("`", "").replace(" ", ""):
            wrong.append(f"{f.name}: default is {want}, README says {default_cell!r}")
    assert wrong == []
