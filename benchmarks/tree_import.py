"""Import a top-level module or package from a given folder without editing sys.path.

A/B benchmarks load an older implementation (written to a scratch folder) next to today's. The package found
in `folder` keeps `folder` as its search location, so its own submodules come from there too."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path


def import_from(folder: Path | str, name: str):
    spec = importlib.machinery.PathFinder.find_spec(name, [str(folder)])
    if spec is None:
        raise ImportError(f"no module {name!r} in {folder}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec: the module's own imports of itself (dataclasses) find it
    spec.loader.exec_module(module)
    return module
