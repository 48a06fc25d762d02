"""The layering rules of ARCHITECTURE.md, checked on the source tree by walking every import (ast), including
the ones inside functions, so that a circle cannot hide behind a late import:
- the core (fleetscope.*, less cli, eval, producers and streams) imports none of those;
- producers and streams never import each other; neither imports the CLI or the harness;
- nothing imports benchmarks or tests, and no test module imports another one;
- there is no sys.path.insert anywhere;
- there are no import circles.
The second half of the file shows that the checker fails on a planted violation of each kind."""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# source folder -> the package it is installed as (pyproject.toml's package-dir)
PACKAGE_DIRS = {"src/fleetscope": "fleetscope", "producers": "fleetscope.producers", "streams": "fleetscope.streams"}
LAYER_OF = (("fleetscope.__main__", "cli"), ("fleetscope.producers", "producers"), ("fleetscope.streams", "streams"), ("fleetscope.cli", "cli"),
            ("fleetscope.eval", "eval"), ("fleetscope", "core"))
FORBIDDEN = {"core": {"producers", "streams", "cli", "eval"}, "producers": {"streams", "cli", "eval"},
             "streams": {"producers", "cli", "eval"}, "eval": set(), "cli": set()}


def layer(module: str) -> str | None:
    for prefix, name in LAYER_OF:
        if module == prefix or module.startswith(prefix + "."):
            return name
    return None


def source_modules(root: Path) -> dict[str, Path]:
    """Installed module name -> file, for every .py file of the namespace under `root`."""
    modules = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def imports_of(path: Path, module: str, known: set[str]) -> set[str]:
    """Every module `path` imports, anywhere in the file; `from a import b` counts as a.b when that is a module."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = source_modules(root)
    return {m: imports_of(p, m, set(modules)) for m, p in modules.items()}


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for module, targets in graph.items():
        mine = layer(module)
        for target in sorted(targets):
            theirs = layer(target)
            if theirs in FORBIDDEN.get(mine, ()):
                out.append(f"{module} ({mine}) imports {target} ({theirs})")
            if target.split(".")[0] in ("benchmarks", "tests", "support"):
                out.append(f"{module} imports {target}, which is not installed")
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), among our own modules."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def path_hacks(root: Path) -> list[str]:
    """Every call of sys.path.insert/append/extend in the tree."""
    hits = []
    for folder in ("src", "producers", "streams", "benchmarks", "tests"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                        node.func.attr in ("insert", "append", "extend") and ast.unparse(node.func.value) == "sys.path":
                    hits.append(f"{path.relative_to(root)}:{node.lineno}")
    return hits


def find_tests_importing_tests(root: Path) -> list[str]:
    out = []
    for path in sorted((root / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            out += [f"{path.name} imports {n}" for n in names
                    if n.split(".")[0].startswith("test_") or n.split(".")[0] in ("tests", "conftest")]
    return out


def test_no_test_imports_another_test_module():
    assert find_tests_importing_tests(REPO) == [], "shared test code goes in tests/support/"


def test_every_layer_imports_only_what_it_may():
    assert layer_violations(import_graph(REPO)) == []


def test_there_are_no_import_circles():
    assert circles(import_graph(REPO)) == []


def test_nothing_edits_sys_path():
    assert path_hacks(REPO) == []


# ---- the checker fails on planted violations --------------------------------------------------------------

def _copy_tree(tmp_path: Path) -> Path:
    for folder in PACKAGE_DIRS:
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "tests").mkdir()
    (tmp_path / "benchmarks").mkdir()
    return tmp_path


def test_a_core_module_importing_streams_is_caught(tmp_path):
    root = _copy_tree(tmp_path)
    with open(root / "src/fleetscope/topics.py", "a") as f:
        f.write("\n\ndef _late():\n    from fleetscope.streams import windows  # noqa\n")
    assert any("fleetscope.topics (core) imports fleetscope.streams.windows" in v
               for v in layer_violations(import_graph(root)))


def test_producers_importing_streams_and_a_circle_are_caught(tmp_path):
    root = _copy_tree(tmp_path)
    (root / "producers/circle_a.py").write_text("from fleetscope.producers import circle_b  # noqa\n")
    (root / "producers/circle_b.py").write_text("def f():\n    from fleetscope.producers import circle_a  # noqa\n"
                                                "    import fleetscope.streams.windows  # noqa\n")
    graph = import_graph(root)
    assert ["fleetscope.producers.circle_a", "fleetscope.producers.circle_b"] in circles(graph)
    assert any("circle_b (producers) imports fleetscope.streams.windows" in v for v in layer_violations(graph))


def test_a_path_hack_and_a_test_importing_a_test_are_caught(tmp_path):
    root = _copy_tree(tmp_path)
    (root / "benchmarks/x_bench.py").write_text("import sys\nsys.path.insert(0, '.')\n")
    (root / "tests/test_a.py").write_text("from test_b import helper  # noqa\n")
    assert path_hacks(root) == ["benchmarks/x_bench.py:2"]
    assert find_tests_importing_tests(root) == ["test_a.py imports test_b"]
