"""PythonTracer: Python function calls and GC from the interpreter's USDT probes.

Probes: python:function__entry / function__return (family "functions",
expensive: every call traps, ~5 us) and python:gc__start / gc__done (family
"gc", always on). Interpreters built without USDT (pyenv, most venvs) are
reported per process with a clear reason (`add_pid` returns False and
`unavailable[pid]` says why).

How the probes are attached: CPython guards each probe with a USDT semaphore,
so a process whose semaphore is 0 skips the probe site entirely. bcc 0.26
sets semaphores by writing the process's memory and only undoes that when its
USDT context is destroyed, which makes a clean detach/re-attach (duty
cycling) awkward. Instead each probe program is attached as a uprobe_multi
link (producers/tracers/uprobes.py) with the semaphore's offset as its
`ref_ctr_offset`: the kernel raises the semaphore when the probe is installed
in the process and lowers it when the link is closed, per process and
atomically, even if the process exits. Detaching a family is closing its
links (one shared grace period); a detached family costs the traced process
nothing.

bcc only generates the USDT argument readers (which registers hold the file
and function name); they are generated once per interpreter binary from a
short-lived USDT context whose semaphore increment it undoes on close.

BPF side: bpf/python.bpf.c aggregates per (pid, function) in maps (see there);
`sample()` diffs the cumulative counters. Rows: python.calls and
python.func_ns per "module:function" (top 50 per pid per interval by calls,
the rest folded into "other"), python.gc_count / python.gc_ns (device "all"),
python.lost_events. Inclusive time of a recursive function counts each level.
"""
from __future__ import annotations

import logging
import os
import re
import time

from fleetscope.wire import Batch
from fleetscope.producers.tracers.duty import DutyClock
from fleetscope.producers.tracers.kernel import BPF_DIR, TracerUnavailable
from fleetscope.producers.tracers.linked import LinkedFamilyTracer
from fleetscope.producers.tracers.rows import diff, metric_batch
from fleetscope.producers.tracers.uprobes import Link, LinkSet, check_host, file_offset, load_multi_program

log = logging.getLogger(__name__)

TOP_N = 50
FAMILY_PROBES = {"functions": (("function__entry", "py_entry"), ("function__return", "py_return")),
                 "gc": (("gc__start", "py_gc_start"), ("gc__done", "py_gc_done"))}
FAMILIES = {"functions": "expensive", "gc": "always"}
PREFIX_MAX, PREFIX_LEN = 8, 160  # as PY_PREFIX_MAX / PY_FILE_LEN in bpf/events.h
# CPython 3.11-3.14 carry a function__entry probe that the interpreter never
# reaches (CPython gh-98894, fixed for 3.15): calls are counted on return
# there, and inclusive time (python.func_ns) cannot be measured.
ENTRY_BROKEN = re.compile(r"python3\.(11|12|13|14)\b")


def python_probes(pid: int) -> tuple[str, dict[str, tuple[int, int]], str]:
    """(object path, {probe: (file offset, semaphore file offset)}, argument-reader C) for a process.

    Raises TracerUnavailable, with the reason, if its interpreter lacks the probes."""
    from bcc import USDT
    exe = os.path.realpath(f"/proc/{pid}/exe") if os.path.exists(f"/proc/{pid}/exe") else "?"
    try:
        ctx = USDT(pid=pid)
        found = {p.name.decode(): p for p in ctx.enumerate_probes() if p.provider == b"python"}
    except Exception as e:
        raise TracerUnavailable(f"cannot read the USDT probes of pid {pid} ({exe}): {e}") from e
    needed = [name for probes in FAMILY_PROBES.values() for name, _ in probes]
    missing = [n for n in needed if n not in found]
    if missing:
        raise TracerUnavailable(
            f"the Python interpreter of pid {pid} ({exe}) has no USDT probe(s) python:{', python:'.join(missing)}: "
            "it was built without --with-dtrace (pyenv and python.org builds usually are). Run the job "
            "with an interpreter that has them (e.g. Debian/Ubuntu /usr/bin/python3; check with "
            "`readelf -n <python or libpython> | grep -A2 stapsdt`)")
    path = found["function__entry"].bin_path.decode()
    offsets = {}
    for name in needed:
        p = found[name]
        loc = p.get_location(0).address
        offsets[name] = (file_offset(path, loc), file_offset(path, p.semaphore) if p.semaphore else 0)
    for name, fn in FAMILY_PROBES["functions"]:
        ctx.enable_probe(f"python:{name}", fn)  # raises the semaphores until ctx is closed
    text = ctx.get_text()
    del ctx  # bcc lowers the semaphores again when the context closes
    return path, offsets, text


def module_name(path: str) -> str:
    """A readable module for a source path: the part after site-packages or the stdlib dir, dotted."""
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            path = path.rsplit(marker, 1)[1]
            break
    else:
        parts = path.split("/")
        stdlib = [i for i, p in enumerate(parts) if p.startswith("python3") and i > 0 and parts[i - 1] == "lib"]
        path = "/".join(parts[stdlib[-1] + 1:]) if stdlib else parts[-1]
    if path.endswith(".py"):
        path = path[:-3]
    if path.endswith("/__init__"):
        path = path[:-9]
    return path.replace("/", ".") or "?"


class PythonTracer(LinkedFamilyTracer):
    FAMILIES = FAMILIES
    source = "python"
    # attaching compiles a USDT program per process (seconds on a busy node): the manager attaches the quick
    # uprobe tracers first, so a rank's torch and CUDA probes never wait behind it
    SLOW_ATTACH = True
    # none: function__return and gc__done are USDT probes inside the interpreter, plain uprobes that
    # replace no return address
    RETURN_PROBES: dict[str, str] = {}

    def __init__(self, host: str, resolver=None, prefixes: tuple[str, ...] = ()):
        """`prefixes`: count only functions whose source file starts with one of these (none: all)."""
        check_host("Python")
        if len(prefixes) > PREFIX_MAX or any(len(p.encode()) > PREFIX_LEN for p in prefixes):
            raise ValueError(f"at most {PREFIX_MAX} file prefixes of at most {PREFIX_LEN} bytes")
        self.host, self.resolver, self.prefixes = host, resolver, tuple(prefixes)
        self.programs: dict[str, object] = {}        # interpreter object path -> BPF
        self.pids: dict[int, tuple[str, dict, bool]] = {}  # pid -> (object path, probe offsets, entry fires)
        self.unavailable: dict[int, str] = {}        # pid -> why it is not traced
        self.enabled = dict.fromkeys(FAMILIES, True)
        self.links = LinkSet(self.RETURN_PROBES)     # (pid, family) -> uprobe_multi links
        self._progs: dict[tuple[str, str], int] = {}  # (object path, BPF function) -> program fd
        self._clock = DutyClock(FAMILIES)
        self._names: dict[tuple, str] = {}           # (path, pid, file, name) -> "module:function"
        self._prev: dict[str, dict] = {"funcs": {}, "gc_count": {}, "gc_ns": {}, "lost": {}}
        self._last_ns = time.time_ns()

    def add_pid(self, pid: int) -> bool:
        pid = int(pid)
        if pid in self.pids:
            return True
        try:
            path, offsets, text = python_probes(pid)
            if path not in self.programs:
                self._load(path, text)
            self.pids[pid] = (path, offsets, not ENTRY_BROKEN.search(os.path.basename(path)))
            for fam, on in self.enabled.items():
                if on:
                    self._attach(pid, fam)
        except (TracerUnavailable, OSError, ValueError) as e:
            self._detach_pid(pid)
            self.pids.pop(pid, None)
            self.unavailable[pid] = str(e)
            log.warning("python tracer: not tracing pid %d: %s", pid, e)
            return False
        self.unavailable.pop(pid, None)
        return True

    def hits(self) -> dict[str, int]:
        out = dict.fromkeys(FAMILIES, 0)
        for bpf in self.programs.values():
            h = bpf[b"hits"]
            for fam, idx in (("functions", 0), ("gc", 1)):
                out[fam] += int(sum(h.getvalue(h.Key(idx))))
        return out

    def sample(self, now_ns: int | None = None) -> Batch | None:
        now_ns = time.time_ns() if now_ns is None else int(now_ns)
        interval = max(now_ns - self._last_ns, 0)
        self._last_ns = now_ns
        frac = self._clock.fractions()
        funcs, gc_count, gc_ns, lost = {}, {}, {}, {}
        for path, bpf in self.programs.items():
            for k, v in bpf[b"fstats"].items():
                if not v.skip:
                    funcs[(path, k.pid, k.file, k.name)] = (v.returns, v.ns)
            for k, v in bpf[b"gc"].items():
                gc_count[(path, k.value)], gc_ns[(path, k.value)] = v.count, v.ns
            lost.update({(path, k.value): v.value for k, v in bpf[b"lost"].items()})
        rows = self._function_rows(funcs, interval, frac["functions"])
        for metric, name, cur in (("python.gc_count", "gc_count", gc_count), ("python.gc_ns", "gc_ns", gc_ns)):
            changed = diff(self._prev[name], cur)
            if frac["gc"] > 0:  # attached: a traced process that did not collect measured a 0, not nothing;
                # without it a job's quiet ranks are masked and the one collecting has no peers to differ from
                for pid, state in self.pids.items():
                    changed.setdefault((state[0], pid), 0)
            rows += [(metric, "all", d, k[1], interval, frac["gc"]) for k, d in changed.items()]
            self._prev[name] = cur
        rows += [("python.lost_events", "all", d, k[1], interval, 1.0)
                 for k, d in diff(self._prev["lost"], lost).items()]
        self._prev["lost"] = lost
        for pid in [p for p in self.pids if not os.path.exists(f"/proc/{p}")]:
            self._forget(pid)  # it exited: its last deltas are in this batch
        return metric_batch(self.source, self.host, rows, now_ns, interval, self._identity) if rows else None

    def close(self) -> None:
        for pid in list(self.pids):
            self.remove_pid(pid)
        programs, self.programs = self.programs, {}
        for bpf in programs.values():
            bpf.cleanup()

    def _family_detached(self, family: str) -> None:
        if family == "functions":
            for bpf in self.programs.values():
                bpf[b"stacks"].clear()  # frames entered now will return unseen

    # ---- tests and diagnostics ----
    def function_counts(self, pid: int) -> dict[str, tuple[int, int]]:
        """Cumulative (entries, returns) per "module:function" for a traced pid, read from the BPF maps."""
        path = self.pids[pid][0]
        out: dict[str, tuple[int, int]] = {}
        for k, v in self.programs[path][b"fstats"].items():
            if k.pid == pid and not v.skip:
                dev = self._device(path, k.pid, k.file, k.name)
                c, r = out.get(dev, (0, 0))
                out[dev] = (c + v.calls, r + v.returns)
        return out

    # ---- internals ----
    def _load(self, path: str, text: str):
        from bcc import BPF
        src = text + "\n" + (BPF_DIR / "python.bpf.c").read_text()
        try:
            bpf = BPF(text=src.encode(), cflags=[f"-I{BPF_DIR}", "-Wno-everything"])
        except Exception as e:  # bcc raises bare Exception on compile/load failure
            raise TracerUnavailable(f"loading bpf/python.bpf.c for {path} failed ({e}); check that kernel headers "
                                    f"exist at /lib/modules/{os.uname().release}/build") from e
        table, count = bpf[b"prefixes"], bpf[b"nprefixes"]
        for i, prefix in enumerate(self.prefixes):
            leaf = table.Leaf()
            leaf.len = len(prefix.encode())
            leaf.text = prefix.encode()
            table[table.Key(i)] = leaf
        count[count.Key(0)] = count.Leaf(len(self.prefixes))
        self.programs[path] = bpf
        return bpf

    def _attach(self, pid: int, family: str) -> None:
        path, offsets, entry_fires = self.pids[pid]
        links = []
        for probe, fn in FAMILY_PROBES[family]:
            if probe == "function__entry" and not entry_fires:
                continue  # never reached: attaching it would only raise its semaphore
            off, sem = offsets[probe]
            links.append(Link(self._prog(path, fn), path, (off,), (0,), ref_ctr_offsets=(sem,) if sem else None))
        self.links.attach((pid, family), links, pid)

    def _prog(self, path: str, fn: str) -> int:
        if (path, fn) not in self._progs:
            self._progs[(path, fn)] = load_multi_program(self.programs[path], fn, "Python")
        return self._progs[(path, fn)]


    def _forget(self, pid: int) -> None:
        """Detach a pid and drop its keys from the maps and the diff state."""
        path = self.pids[pid][0]
        self.remove_pid(pid)
        bpf = self.programs[path]
        for name in (b"fstats", b"fnames"):
            table = bpf[name]
            for k in [k for k in table.keys() if k.pid == pid]:
                table.pop(k, None)
        for name in (b"gc", b"lost"):
            bpf[name].pop(bpf[name].Key(pid), None)
        for prev in self._prev.values():
            for k in [k for k in prev if k[1] == pid]:
                del prev[k]
        for k in [k for k in self._names if k[1] == pid]:
            del self._names[k]

    def _device(self, path: str, pid: int, file: int, name: int) -> str:
        key = (path, pid, file, name)
        dev = self._names.get(key)
        if dev is None:
            table = self.programs[path][b"fnames"]
            leaf = table.get(table.Key(pid, 0, file, name))
            if leaf is None:
                return "?:?"  # not cached yet (transient); not remembered
            dev = self._names[key] = f"{module_name(leaf.file.decode(errors='replace'))}:" \
                                     f"{leaf.name.decode(errors='replace')}"
        return dev

    def _function_rows(self, funcs: dict, interval: int, frac: float) -> list[tuple]:
        """python.calls / python.func_ns deltas: top TOP_N devices per pid by calls, the rest as "other"."""
        prev = self._prev["funcs"]
        per_pid: dict[int, dict[str, list[int]]] = {}
        for key, (calls, ns) in funcs.items():
            pc, pn = prev.get(key, (0, 0))
            dc, dn = (calls - pc, ns - pn) if calls >= pc else (calls, ns)
            if dc or dn:
                acc = per_pid.setdefault(key[1], {}).setdefault(self._device(*key), [0, 0])
                acc[0] += dc
                acc[1] += dn
        self._prev["funcs"] = funcs
        rows = []
        for pid, devs in per_pid.items():
            ranked = sorted(devs.items(), key=lambda kv: -kv[1][0])
            other = [sum(v[0] for _, v in ranked[TOP_N:]), sum(v[1] for _, v in ranked[TOP_N:])]
            kept = ranked[:TOP_N] + ([("other", other)] if len(ranked) > TOP_N else [])
            timed = pid in self.pids and self.pids[pid][2]
            for dev, (dc, dn) in kept:
                rows.append(("python.calls", dev, dc, pid, interval, frac))
                if timed:
                    rows.append(("python.func_ns", dev, dn, pid, interval, frac))
        return rows
