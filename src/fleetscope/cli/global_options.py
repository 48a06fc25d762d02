"""Options every command takes, before or after the subcommand: `fleetscope -v kb list` and
`fleetscope kb list -v` mean the same. The top-level parser holds the defaults; each subcommand's copy uses
SUPPRESS, so it sets a value only when given and never resets one given before the subcommand."""
from __future__ import annotations

import argparse
from importlib import metadata


def version() -> str:
    try:
        return metadata.version("fleetscope")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _add(parser: argparse.ArgumentParser, top: bool) -> None:
    extra = {} if top else {"default": argparse.SUPPRESS}
    parser.add_argument("--config", metavar="FILE", help="TOML config file (default: $FLEETSCOPE_CONFIG)",
                        **({"default": None} if top else extra))
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging", **extra)


def add_global_options(parser: argparse.ArgumentParser) -> None:
    """Give `parser` and every subcommand below it --config and -v; the top level also gets --version."""
    _add(parser, top=True)
    parser.add_argument("--version", action="version", version=f"fleetscope {version()}",
                        help="print the installed version and exit")
    for sub in subcommand_parsers(parser):
        _add(sub, top=False)


def subcommand_parsers(parser: argparse.ArgumentParser):
    """Every parser below `parser`, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                yield child
                yield from subcommand_parsers(child)
