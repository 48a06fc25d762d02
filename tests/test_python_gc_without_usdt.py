"""PythonTracer on interpreters without USDT probes: GC is traced from the collector's symbol.

Real eBPF, real processes: the venv's interpreter (a pyenv build: no USDT, but
its libpython keeps .symtab with gc_collect_main) runs a script with a known
number of gc.collect() calls, and so do pyenv's CPython 3.8 and 3.9 (the
collector is `collect` there: two .constprop clones in 3.8's build, one
function in 3.9's); a stripped copy of the venv's has neither and is refused;
Debian's /usr/bin/python3 (USDT) keeps the USDT path.
"""
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from fleetscope.producers.tracers.python_vm import COLLECTORS
from support.python_scripts import ScriptProcesses
from support.batch_rows import rows, wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="loading BPF programs needs root (CI runs as root)")

DEBIAN_PYTHON = "/usr/bin/python3"
PYENV_VERSIONS = Path(os.environ.get("PYENV_ROOT", "/root/.pyenv")) / "versions"
# (label, interpreter, the collector symbols it must be traced through)
INTERPRETERS = [("venv", sys.executable, ("gc_collect_main", "_PyGC_Collect"))] + [
    (f"cpython{v}", str(exe), ("collect",))
    for v in ("3.8", "3.9") for exe in sorted(PYENV_VERSIONS.glob(f"{v}.*/bin/python{v}"))[-1:]]
COLLECTS = 20
# Waits for argv[1], makes COLLECTS rounds of cyclic garbage each collected explicitly, prints what each
# collection found, writes argv[1].done, then waits (at most 60 s) for argv[1].exit and exits 0.
SCRIPT = f"""
import gc, os, sys, time

def wait(path):
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)

go = sys.argv[1]
wait(go)
found = []
for _ in range({COLLECTS}):
    for _ in range(100):
        a = []
        a.append(a)
    del a
    found.append(gc.collect())
print(found)
open(go + ".done", "w").close()
wait(go + ".exit")
"""


@pytest.fixture(scope="module")
def tracer():
    from fleetscope.producers.tracers.python_vm import PythonTracer
    t = PythonTracer("node-a")
    yield t
    t.close()


@pytest.fixture
def spawn(tmp_path):
    script = tmp_path / "gc_loop.py"
    script.write_text(SCRIPT)
    procs = ScriptProcesses(script)
    yield procs.start
    procs.stop()


def gc_only_or_skip(pid, python):
    """Skip unless the interpreter is one this test is about: no USDT, a collector symbol."""
    from fleetscope.producers.tracers.python_vm import UsdtMissing, gc_collector, python_probes
    try:
        python_probes(pid)
        pytest.skip(f"{python} has the USDT probes: it takes the USDT path, not the GC-only one")
    except UsdtMissing:
        pass
    try:
        gc_collector(pid)
    except LookupError as e:
        pytest.skip(f"{python} has no USDT and no collector symbol: {e}")


def untraced_output(spawn, tmp_path, python=sys.executable):
    go = tmp_path / "plain"
    go.touch()
    p = spawn(go, python=python)
    wait_for(f"{go}.done")
    Path(f"{go}.exit").touch()
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0
    return out


def test_cpython_38_and_39_are_found_on_this_machine():
    """The interpreters the next test runs: CI's machine has pyenv's 3.8 and 3.9; their absence is a
    failure here, not a quiet skip of the versions the collector name `collect` is for."""
    assert {label for label, _, _ in INTERPRETERS} == {"venv", "cpython3.8", "cpython3.9"}, (
        f"no pyenv CPython 3.8 or 3.9 under {PYENV_VERSIONS} (set PYENV_ROOT): the collector `collect` is untested")


@pytest.mark.parametrize("python,symbols", [i[1:] for i in INTERPRETERS], ids=[i[0] for i in INTERPRETERS])
def test_gc_of_an_interpreter_without_usdt_is_traced_from_its_collector(tracer, spawn, tmp_path, python, symbols):
    expected = untraced_output(spawn, tmp_path, python)
    go = tmp_path / "go"
    p = spawn(go, python=python)
    if python == sys.executable:  # whatever the venv was made from; pyenv's 3.8 and 3.9 are known: no skip
        gc_only_or_skip(p.pid, python)
    assert tracer.add_pid(p.pid), tracer.unavailable.get(p.pid)
    assert p.pid in tracer.gc_only and p.pid not in tracer.unavailable
    why = tracer.gc_only[p.pid]
    assert "function calls are not traced" in why and "no USDT probe" in why
    assert any(name in why for name in COLLECTORS)
    probed = tracer.pids[p.pid][3]
    assert probed and all(re.fullmatch(rf"(?:{'|'.join(symbols)})(?:\.\w+\.\d+)*", n) for n in probed), probed
    assert tracer.pids[p.pid][3] and (p.pid, "gc") in tracer.links and (p.pid, "functions") not in tracer.links
    first = tracer.sample()  # before the collections: whatever start-up collected
    got = rows(first) if first is not None else []
    go.touch()
    wait_for(f"{go}.done")
    got += rows(tracer.sample())
    total = {m: sum(r["value"] for r in got if r["pid"] == p.pid and r["metric"] == m and r["device"] == "all")
             for m in ("python.gc_count", "python.gc_ns")}
    assert total["python.gc_count"] >= COLLECTS and total["python.gc_ns"] > 0, total
    assert not [r for r in got if r["pid"] == p.pid and r["metric"] in ("python.calls", "python.func_ns")]
    assert tracer.function_counts(p.pid) == {}
    # the families still switch with a GC-only process among the traced ones
    tracer.set_family_enabled("functions", False)
    tracer.set_family_enabled("functions", True)
    assert (p.pid, "functions") not in tracer.links and (p.pid, "gc") in tracer.links
    assert tracer.families() == {"functions": "expensive", "gc": "always"}
    Path(f"{go}.exit").touch()
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0 and out == expected


def test_debian_python_keeps_the_usdt_path(tracer, spawn, tmp_path):
    if not os.path.exists(DEBIAN_PYTHON):
        pytest.skip(f"no {DEBIAN_PYTHON} here")
    p = spawn(tmp_path / "never", python=DEBIAN_PYTHON)
    assert tracer.add_pid(p.pid), tracer.unavailable.get(p.pid)
    assert p.pid not in tracer.gc_only and tracer.pids[p.pid][3] == ()
    assert (p.pid, "functions") in tracer.links and (p.pid, "gc") in tracer.links


def test_stripped_interpreter_without_usdt_is_refused_naming_both(tracer, spawn, tmp_path):
    strip = shutil.which("strip")
    libdir = sysconfig.get_config_var("LIBDIR")
    libname = sysconfig.get_config_var("INSTSONAME")
    if not strip or not libname or not os.path.exists(os.path.join(libdir or "", libname)):
        pytest.skip("needs `strip` and a shared libpython to make a stripped stand-in interpreter")
    standin = tmp_path / "stripped"
    standin.mkdir()
    exe = standin / "python3"
    shutil.copy(os.path.realpath(sys.executable), exe)
    shutil.copy(os.path.join(libdir, libname), standin / libname)
    subprocess.run([strip, "--strip-all", str(exe), str(standin / libname)], check=True)
    p = spawn(tmp_path / "never", python=str(exe),
              env={"LD_LIBRARY_PATH": str(standin), "PYTHONHOME": sys.base_prefix})
    assert str(standin / libname) in Path(f"/proc/{p.pid}/maps").read_text()  # the stripped copy, not the venv's
    assert tracer.add_pid(p.pid) is False
    why = tracer.unavailable[p.pid]
    assert "no USDT probe" in why and "gc_collect_main" in why and "_PyGC_Collect" in why and str(p.pid) in why
    assert p.pid not in tracer.pids and p.pid not in tracer.gc_only


@pytest.mark.parametrize("source,taken", [
    ("int collect(int g) { return g; }", False),  # a `collect` that is not CPython's collector
    ("int collect(int g) { return g; } int _PyGC_CollectNoFail(void) { return collect(2); }", True),
])
def test_the_old_collector_name_is_taken_only_beside_cpythons_own_entry_into_it(tmp_path, source, taken):
    """`collect` (3.6-3.9) is a common name: an object that does not also define _PyGC_CollectNoFail is not
    searched for it. Real ELF objects built by gcc, read by the tracer's own symbol reader; no root."""
    from fleetscope.producers.tracers.python_vm import _collector_in
    if not shutil.which("gcc"):
        pytest.fail("gcc is needed to build the test objects (install.sh installs it)")
    (tmp_path / "gc.c").write_text(source + "\n")
    lib = tmp_path / "libpython3.9.so.1.0"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O0", "-o", str(lib), str(tmp_path / "gc.c")], check=True)
    st = lib.stat()
    offsets, names = _collector_in(str(lib), st.st_ino, st.st_mtime_ns)
    assert (names == ("collect",) and len(offsets) == 1) if taken else (offsets, names) == ((), ())
