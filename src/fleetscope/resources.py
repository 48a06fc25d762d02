"""Where the installed data packages live: fleetscope.sql, fleetscope.kb, fleetscope.bpf and the harness's files.

They are read through importlib.resources, so a wheel installed anywhere finds them, and a checkout never
shadows what is installed. bcc and gcc need real file paths, so a data package must be installed as files
(every pip install is), not inside a zip.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path


def package_dir(package: str) -> Path:
    """The folder of an installed package, e.g. package_dir("fleetscope.sql")."""
    root = resources.files(package)
    path = Path(str(root))
    if not path.is_dir():
        raise FileNotFoundError(f"{package} is not installed as plain files ({root}); reinstall fleetscope with pip")
    return path
