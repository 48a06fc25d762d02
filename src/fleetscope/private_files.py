"""Files the stack writes under its data directory are its own: 0600 files, 0700 directories.

The audit found `fleetscope up`'s logs 0644 under umask 022; they hold hosts, jobs and error text.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO


def open_private_append(path: str | os.PathLike) -> BinaryIO:
    """Append to `path`, created 0600 (an existing file is made 0600 too)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "ab")


def open_private_write(path: str | os.PathLike) -> BinaryIO:
    """Write `path` anew, created 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "wb")


def private_dir(path: str | os.PathLike) -> Path:
    """Make `path` (and its parents) and set it 0700, also when it existed already."""
    p = Path(path)
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    p.chmod(0o700)
    return p


def private_umask() -> None:
    """In a child between fork and exec: what it creates is not readable by group or others."""
    os.umask(os.umask(0o077) | 0o077)
