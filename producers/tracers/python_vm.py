"""PythonTracer: Python function calls and GC from the interpreter's USDT probes.

Probes: python:function__entry / function__return (family "functions",
expensive: every call traps, ~5 us) and python:gc__start / gc__done (family
"gc", always on).

Interpreters built without USDT (pyenv, python.org builds, most venvs) are
traced for GC only: the collector's core function, found by name in the
symbol table of the executable or libpython the process maps (gc_collect_main
in CPython 3.10-3.13; _PyGC_Collect, which holds the collection itself from
3.14; `collect` in 3.6-3.9, often with .constprop clones, every one probed;
tested on 3.8 and 3.9),
gets the same two BPF programs as the USDT probes: py_gc_start
as a uprobe at its entry, py_gc_done as a uretprobe at its return. Both USDT
probes sit inside that function, so the count and time are the same up to
its few instructions before and after them (and a rare early return when
another thread is already collecting, counted as a very short collection).
The return probe is safe (RETURN_PROBES): the collector is CPython C code,
its errors are return values, and nothing unwinds through it (a C++
extension must stop its exceptions at its own boundary; pybind11 and torch
turn them into Python exceptions there), so the replaced return address is
always reached. Such a pid has no "functions" family: `gc_only[pid]` says
why (and it is logged). A stripped interpreter without USDT has neither: it
is refused (`add_pid` returns False and `unavailable[pid]` names both).

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
short-lived USDT context whose semaphore increment it undoes on close. A
GC-only interpreter's program is compiled without them (-DGC_ONLY).

BPF side: bpf/python.bpf.c aggregates per (pid, function) in maps (see there);
`sample()` diffs the cumulative counters. Rows: python.calls and
python.func_ns per "module:function" (top 50 per pid per interval by calls,
the rest folded into "other"), python.gc_count / python.gc_ns (device "all"),
python.lost_events. Inclusive time of a recursive function counts each level.

Detail mode (detail=True: -DDETAIL, as for the CUDA, NCCL and torch tracers; producers/tracers/detail.py):
while the BPF detail gate is open (`set_detail_until`, or for the whole run with detail_always), each GC pause
(every interpreter, GC-only ones included) and each timed function call (only where function__entry fires:
not CPython 3.11-3.14, see ENTRY_BROKEN) sends a record, and `sample()` drains them into `records`:
{"api": "gc", or the function's "module:function" as in its rows, "pid", "tid", "ts_ns" (start, epoch ns),
"dur_ns", "family": "gc" or "functions"}. Every interpreter object's program has its own ring and gate; one
loaded later gets the current deadline. The records come from the same programs (no probe is added).
"""
from __future__ import annotations

import functools
import logging
import os
import re
import struct
import time

from fleetscope.wire import Batch
from fleetscope.producers.tracers.detail import DetailRecords, detail_flags
from fleetscope.producers.tracers.discovery import host_path, mapped_objects
from fleetscope.producers.tracers.duty import DutyClock
from fleetscope.producers.tracers.kernel import BPF_DIR, TracerUnavailable
from fleetscope.producers.tracers.linked import LinkedFamilyTracer
from fleetscope.producers.tracers.rows import diff, metric_batch
from fleetscope.producers.tracers.symbols import parse_elf
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
# The collector's core, by preference: each USDT GC probe pair sits inside it. A name may carry a
# compiler clone suffix (an LTO build's copy is still the whole function; .part/.cold pieces are not).
# CPython 3.6-3.9 call it `collect` (gcmodule.c), a name common enough that it is taken only from an
# object that also defines CPython's own entry into it, and only if one function (with its clones) has it.
COLLECTORS = ("gc_collect_main", "_PyGC_Collect", "collect")
GENERIC_COLLECTOR, GC_MODULE_MARK = "collect", "_PyGC_CollectNoFail"
_CLONE = r"(?:\.(?:lto_priv|constprop|isra)\.\d+)*"
LIBPYTHON = re.compile(r"/libpython3[^/]*\.so[.\d]*$")
PYTHON_EXE = re.compile(r"/python[^/]*$")  # an executable searched for the collector (a static build holds it)


class UsdtMissing(TracerUnavailable):
    """The interpreter was built without the USDT probes."""


class UsdtUnreadable(TracerUnavailable):
    """bcc could not read the process's USDT probes this time (seen on loaded hosts while it mapped libraries:
    "USDT failed to instrument PID"); a process without any has an empty list, not this."""


def python_probes(pid: int) -> tuple[str, dict[str, tuple[int, int]], str]:
    """(object path, {probe: (file offset, semaphore file offset)}, argument-reader C) for a process.

    Raises TracerUnavailable, with the reason, if its interpreter lacks the probes."""
    from bcc import USDT
    exe = os.path.realpath(f"/proc/{pid}/exe") if os.path.exists(f"/proc/{pid}/exe") else "?"
    try:
        ctx = USDT(pid=pid)
        found = {p.name.decode(): p for p in ctx.enumerate_probes() if p.provider == b"python"}
    except Exception as e:
        raise UsdtUnreadable(f"cannot read the USDT probes of pid {pid} ({exe}): {e}") from e
    needed = [name for probes in FAMILY_PROBES.values() for name, _ in probes]
    missing = [n for n in needed if n not in found]
    if missing:
        raise UsdtMissing(
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


@functools.lru_cache(maxsize=32)
def _collector_in(path: str, inode: int, mtime_ns: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(file offsets, symbol names) of the preferred collector function defined in an object; ((), ())
    if it defines none. Cached per file version: the ranks of a job share one libpython."""
    with open(path, "rb") as f:
        elf = parse_elf(f.read())
    for name in COLLECTORS:
        rx = re.compile(re.escape(name) + _CLONE)
        found = {a: n for n, a in zip(elf.names, elf.starts) if rx.fullmatch(n)}
        if name == GENERIC_COLLECTOR and (GC_MODULE_MARK not in elf.names or list(found.values()).count(name) > 1):
            continue
        if found:
            return tuple(file_offset(path, a) for a in found), tuple(found.values())
    return (), ()


def gc_collector(pid: int) -> tuple[str, tuple[int, ...], tuple[str, ...]]:
    """(host path of the object, file offsets, symbols) of the GC collector in a process's interpreter:
    a mapped libpython, or its executable if that is named python*. Only those are read (whole): a process
    that is not Python costs nothing. Raises LookupError, naming the objects searched, if none has it."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError as e:
        raise LookupError(f"pid {pid} is gone ({e})") from e
    searched = []
    for obj in mapped_objects(pid):
        if not LIBPYTHON.search(obj) and not (obj == exe and PYTHON_EXE.search(obj)):
            continue
        path = host_path(pid, obj)
        searched.append(obj)
        try:
            st = os.stat(path)
            offsets, names = _collector_in(path, st.st_ino, st.st_mtime_ns)
        except (OSError, ValueError, struct.error, IndexError) as e:
            log.debug("python tracer: cannot read the symbols of %s (pid %d): %s", obj, pid, e)
            continue
        if offsets:
            return path, offsets, names
    where = ", ".join(searched) or "no python* executable or libpython"
    raise LookupError(f"no symbol {' or '.join(COLLECTORS)} in {where} (stripped?)")


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


class PythonTracer(DetailRecords, LinkedFamilyTracer):
    FAMILIES = FAMILIES
    source = "python"
    # attaching compiles a USDT program per process (seconds on a busy node): the manager attaches the quick
    # uprobe tracers first, so a rank's torch and CUDA probes never wait behind it
    SLOW_ATTACH = True
    # function__return and gc__done are USDT probes inside the interpreter, plain uprobes that replace no
    # return address. Without USDT, the collector's return is a uretprobe (see the module docstring).
    RETURN_PROBES: dict[str, str] = {
        "(?:" + "|".join(map(re.escape, COLLECTORS)) + ")" + _CLONE:
            "CPython's C collector: its errors are return values and no exception unwinds through it "
            "(C++ extensions stop theirs at their own boundary), so the replaced return address is reached"}

    def __init__(self, host: str, resolver=None, prefixes: tuple[str, ...] = (), detail: bool = False,
                 ring_pages: int = 1024, detail_always: bool = True):
        """`prefixes`: count only functions whose source file starts with one of these (none: all). `detail`:
        per-call records while the gate is open, from construction on with `detail_always` (module doc)."""
        check_host("Python")
        if len(prefixes) > PREFIX_MAX or any(len(p.encode()) > PREFIX_LEN for p in prefixes):
            raise ValueError(f"at most {PREFIX_MAX} file prefixes of at most {PREFIX_LEN} bytes")
        self.host, self.resolver, self.prefixes = host, resolver, tuple(prefixes)
        self.programs: dict[str, object] = {}        # interpreter object path -> BPF
        # pid -> (object path, {probe: offsets}, entry fires, collector symbols: () unless GC-only)
        self.pids: dict[int, tuple[str, dict, bool, tuple[str, ...]]] = {}
        self.unavailable: dict[int, str] = {}        # pid -> why it is not traced
        self.gc_only: dict[int, str] = {}            # pid -> why only its GC is traced (no USDT)
        self.enabled = dict.fromkeys(FAMILIES, True)
        self.links = LinkSet(self.RETURN_PROBES)     # (pid, family) -> uprobe_multi links
        self._progs: dict[tuple[str, str], int] = {}  # (object path, BPF function) -> program fd
        self._clock = DutyClock(FAMILIES)
        self._names: dict[tuple, str] = {}           # (path, pid, file, name) -> "module:function"
        self._prev: dict[str, dict] = {"funcs": {}, "gc_count": {}, "gc_ns": {}, "lost": {}}
        self._last_ns = time.time_ns()
        self._ring_pages = ring_pages
        self._init_detail(detail, detail_always, "python")  # records, the gate, set_detail_until (detail.py)

    def add_pid(self, pid: int) -> bool:
        pid = int(pid)
        if pid in self.pids:
            return True
        try:
            try:
                path, offsets, text = python_probes(pid)
                self.pids[pid] = (path, offsets, not ENTRY_BROKEN.search(os.path.basename(path)), ())
            except UsdtMissing as no_usdt:
                path, text = self._gc_only(pid, no_usdt), None
            if path not in self.programs:
                self._load(path, text)
            for fam, on in self.enabled.items():
                if on:
                    self._attach(pid, fam)
        except (UsdtUnreadable, OSError) as e:  # this time only (a probe's link, the USDT notes): the manager
            self.remove_pid(pid)              # tries it again after a while (producers/tracers/manager.py),
            self.unavailable[pid] = str(e)    # unless the process is gone (it drops it at its next poll)
            if os.path.exists(f"/proc/{pid}"):
                raise
            return False
        except (TracerUnavailable, ValueError) as e:
            self.remove_pid(pid)
            self.unavailable[pid] = str(e)
            log.warning("python tracer: not tracing pid %d: %s", pid, e)
            return False
        self.unavailable.pop(pid, None)
        if pid in self.gc_only:
            log.warning("python tracer: pid %d: %s", pid, self.gc_only[pid])
        return True

    def remove_pid(self, pid: int) -> None:
        super().remove_pid(pid)
        self.gc_only.pop(int(pid), None)

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
        self._drain_records()  # detail mode: this sample's records, named before an exited pid is forgotten
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
        self._close_detail()
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
    def _gc_only(self, pid: int, no_usdt: UsdtMissing) -> str:
        """Record `pid` as traced for GC only, from its collector symbol; its object path.
        Raises TracerUnavailable naming both missing ways if it has no such symbol either."""
        try:
            path, offs, names = gc_collector(pid)
        except LookupError as e:
            raise TracerUnavailable(f"{no_usdt}. Nor can its GC be traced without them: {e}; neither its "
                                    "function calls nor its GC are traced") from no_usdt
        self.pids[pid] = (path, {"collector": offs}, False, names)
        self.gc_only[pid] = (f"function calls are not traced: {no_usdt}. GC is traced from "
                             f"{', '.join(sorted(set(names)))} in {path} (entry and return probes)")
        return path

    def _load(self, path: str, text: str | None):
        """Compile bpf/python.bpf.c for one interpreter object: with bcc's USDT argument readers (`text`),
        or with None for a GC-only interpreter (-DGC_ONLY: only the GC programs)."""
        from bcc import BPF
        src = (text + "\n" if text is not None else "") + (BPF_DIR / "python.bpf.c").read_text()
        flags = [f"-I{BPF_DIR}", "-Wno-everything", *detail_flags(self.detail, self._ring_pages)] + (
            ["-DGC_ONLY"] if text is None else [])
        try:
            bpf = BPF(text=src.encode(), cflags=flags)
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
        self._detail_program(bpf, functools.partial(self._on_program_record, path))  # at the current gate
        return bpf

    def _on_program_record(self, path: str, ctx, data, size) -> None:
        """One detail record from the program of interpreter object `path`."""
        ev = self.programs[path][b"calls"].event(data)
        pid = int(ev.pid)
        if ev.kind == 1:
            api, family = "gc", "gc"
        else:
            api, family = self._device(path, pid, int(ev.file), int(ev.name)), "functions"
        self.records.append({"api": api, "pid": pid, "tid": int(ev.tid), "ts_ns": self.clock.to_epoch_ns(ev.ts),
                             "dur_ns": int(ev.dur_ns), "family": family})

    def _attach(self, pid: int, family: str) -> None:
        path, offsets, entry_fires, collector = self.pids[pid]
        if collector:  # GC-only: the collector's entry (gc__start) and return (gc__done), no function probes
            if family == "gc":
                start, done = (self._prog(path, fn) for _, fn in FAMILY_PROBES["gc"])
                offs = offsets["collector"]
                self.links.attach((pid, family), [
                    Link(start, path, offs, (0,) * len(offs)),
                    Link(done, path, offs, (0,) * len(offs), retprobe=True, symbols=collector)], pid)
            return
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
