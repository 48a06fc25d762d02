"""The topic flags that `agent` and `streams` share: on a managed cluster, nobody but an admin creates topics."""
from __future__ import annotations

import argparse
from dataclasses import replace

from fleetscope.config import Config


def add_topic_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-create-topics", dest="create_topics", action="store_false", default=None,
                        help="only check that the topics exist (for clusters where an admin creates them; "
                             "same as FLEETSCOPE_CREATE_TOPICS=false)")


def with_topic_flags(cfg: Config, args) -> Config:
    if getattr(args, "create_topics", None) is False:
        return replace(cfg, create_topics=False)
    return cfg
