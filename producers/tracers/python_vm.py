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
cycling) awkward. Instead each probe is one uprobe perf event opened here
with the kernel's `ref_ctr_offset`: the kernel raises the semaphore when the
probe is installed in the process and lowers it when the fd is closed, per
process and atomically, even if the process exits. Detaching a family is
closing its fds; a detached family costs the traced process nothing.

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

import ctypes
import fcntl
import logging
import os
import re
import struct
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from fleetscope.schema import SOURCE_COLUMNS
from fleetscope.wire import Batch, StrColumn
from producers.tracers.kernel import BPF_DIR, KernelTracer, TracerUnavailable

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

_libc = ctypes.CDLL(None, use_errno=True)
_NR_PERF_EVENT_OPEN = 298  # x86_64
_PERF_EVENT_IOC_ENABLE, _PERF_EVENT_IOC_SET_BPF = 0x2400, 0x40042408
_PERF_FLAG_FD_CLOEXEC = 8


def _uprobe_pmu_type() -> int:
    try:
        with open("/sys/bus/event_source/devices/uprobe/type") as f:
            return int(f.read())
    except OSError as e:
        raise TracerUnavailable(f"this kernel has no uprobe PMU ({e}); USDT tracing needs uprobes") from e


def attach_uprobe_fd(prog_fd: int, path: str, offset: int, pid: int, ref_ctr_offset: int = 0,
                     retprobe: bool = False) -> int:
    """One uprobe on `path`+`offset` in process `pid`, running `prog_fd`; close the fd to detach.

    With `ref_ctr_offset` (a USDT semaphore's file offset) the kernel keeps
    the process's semaphore raised while the probe is installed."""
    attr = ctypes.create_string_buffer(128)
    cpath = ctypes.create_string_buffer(path.encode())
    struct.pack_into("<IIQ", attr, 0, _uprobe_pmu_type(), 128, ref_ctr_offset << 32 | retprobe)
    struct.pack_into("<QQ", attr, 56, ctypes.addressof(cpath), offset)  # config1, config2
    fd = _libc.syscall(_NR_PERF_EVENT_OPEN, attr, pid, -1, -1, _PERF_FLAG_FD_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"perf_event_open(uprobe {path}+{offset:#x}, pid {pid}): {os.strerror(err)}")
    try:
        fcntl.ioctl(fd, _PERF_EVENT_IOC_SET_BPF, prog_fd)
        fcntl.ioctl(fd, _PERF_EVENT_IOC_ENABLE, 0)
    except OSError:
        os.close(fd)
        raise
    return fd


BPF_TRACE_UPROBE_MULTI, _BPF_LINK_CREATE, _NR_BPF = 48, 28, 321  # x86_64


def attach_uprobe_multi(prog_fd: int, path: str, offsets: list[int], cookies: list[int], pid: int,
                        retprobe: bool = False) -> int:
    """One uprobe_multi link: `prog_fd` (loaded with expected attach type BPF_TRACE_UPROBE_MULTI) at every
    file offset of `path` in process `pid`, each probe with its BPF cookie. Close the fd to detach.

    Removing a uprobe waits for a kernel grace period (~0.1 s here); a link
    removes all its probes with one wait, where single perf events took 16 s
    for 126 probes."""
    n = len(offsets)
    c_path = ctypes.create_string_buffer(path.encode())
    c_offsets = (ctypes.c_uint64 * n)(*offsets)
    c_cookies = (ctypes.c_uint64 * n)(*cookies)
    attr = ctypes.create_string_buffer(128)
    struct.pack_into("<IIII", attr, 0, prog_fd, 0, BPF_TRACE_UPROBE_MULTI, 0)
    struct.pack_into("<QQQQIII", attr, 16, ctypes.addressof(c_path), ctypes.addressof(c_offsets), 0,
                     ctypes.addressof(c_cookies), n, 1 if retprobe else 0, pid)
    fd = _libc.syscall(_NR_BPF, _BPF_LINK_CREATE, attr, 128)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bpf(LINK_CREATE uprobe_multi, {n} probes in {path}, pid {pid}): {os.strerror(err)}")
    return fd


def close_all(fds) -> None:
    """Close uprobe perf event fds, concurrently.

    Each uprobe removal waits for an RCU grace period in the kernel (~0.1 s
    here); closed one after another, 126 probes took 16 s. Concurrent closes
    share grace periods."""
    fds = list(fds)
    if len(fds) <= 2:
        for fd in fds:
            os.close(fd)
        return
    with ThreadPoolExecutor(max_workers=min(len(fds), 64)) as pool:
        list(pool.map(os.close, fds))


def file_offset(path: str, vaddr: int) -> int:
    """The file offset of a virtual address in an ELF64 object, via its PT_LOAD segments."""
    with open(path, "rb") as f:
        hdr = f.read(64)
        if hdr[:4] != b"\x7fELF" or hdr[4] != 2:
            raise ValueError(f"{path} is not a 64-bit ELF object")
        phoff, = struct.unpack_from("<Q", hdr, 32)
        phentsize, phnum = struct.unpack_from("<HH", hdr, 54)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz, p_memsz = struct.unpack_from("<IIQQQQQ", table, i * phentsize)
        if p_type == 1 and p_vaddr <= vaddr < p_vaddr + max(p_filesz, p_memsz):
            return vaddr - p_vaddr + p_offset
    raise ValueError(f"address {vaddr:#x} is in no loadable segment of {path}")


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


class DutyClock:
    """How long each family was attached during each sample interval."""

    def __init__(self, families):
        now = time.monotonic_ns()
        self.on_since = {f: now for f in families}
        self.on_ns = dict.fromkeys(families, 0)

    def set(self, family: str, on: bool) -> None:
        now = time.monotonic_ns()
        since = self.on_since[family]
        if on and since is None:
            self.on_since[family] = now
        elif not on and since is not None:
            self.on_ns[family] += now - since
            self.on_since[family] = None

    def fractions(self, interval_ns: int) -> dict[str, float]:
        """Fraction of the interval each family was on; starts the next interval."""
        now = time.monotonic_ns()
        out = {}
        for fam, since in self.on_since.items():
            on = self.on_ns[fam] + (now - since if since is not None else 0)
            out[fam] = min(on / interval_ns, 1.0) if interval_ns > 0 else (1.0 if since is not None else 0.0)
            self.on_ns[fam] = 0
            if since is not None:
                self.on_since[fam] = now
        return out


def traced_batch(source: str, host: str, rows: list[tuple], now_ns: int, interval: int, identity) -> Batch:
    """One Batch of delta rows (metric, device, value, pid, sample_frac) for a traced source."""
    n = len(rows)
    metrics, devices, values, pids, fracs = zip(*rows)
    idents = {pid: identity(pid) for pid in set(pids)}  # one resolve per process per tick
    tenants, jobs, ranks, gpus = zip(*(idents[p] for p in pids))
    columns = {"ts_ns": np.full(n, now_ns, dtype="<i8"), "tenant": StrColumn.of(tenants),
               "job": StrColumn.of(jobs), "rank": np.array(ranks, dtype="<i4"),
               "pid": np.array(pids, dtype="<i4"), "gpu": np.array(gpus, dtype="<i2"),
               "metric": StrColumn.of(metrics), "device": StrColumn.of(devices),
               "value": np.array(values, dtype="<f8"), "interval_ns": np.full(n, interval, dtype="<i8"),
               "sample_frac": np.array(fracs, dtype="<f8")}
    return Batch(source=source, host=host, created_ns=now_ns,
                 columns={name: columns[name] for name in SOURCE_COLUMNS[source]})


def diff(prev: dict, current: dict) -> dict:
    """Positive increases since `prev` per key (a value that shrank was re-created: count it whole)."""
    out = {}
    for k, v in current.items():
        d = v - prev.get(k, 0)
        if d < 0:
            d = v
        if d > 0:
            out[k] = d
    return out


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


def _check_root() -> None:
    if os.geteuid() != 0:
        raise TracerUnavailable("USDT/uprobe tracing loads BPF programs and needs root (or CAP_BPF+CAP_PERFMON): "
                                "run the agent as root or in a privileged container")
    try:
        import bcc  # noqa: F401  Debian's python3-bpfcc; the PyPI "bcc" is unrelated
    except ImportError as e:
        raise TracerUnavailable(f"bcc is not importable ({e}): install Debian's python3-bpfcc "
                                "and run install.sh, which links it into the venv") from e
    _uprobe_pmu_type()


class PythonTracer:
    source = "python"

    def __init__(self, host: str, resolver=None, prefixes: tuple[str, ...] = ()):
        """`prefixes`: count only functions whose source file starts with one of these (none: all)."""
        _check_root()
        if len(prefixes) > PREFIX_MAX or any(len(p.encode()) > PREFIX_LEN for p in prefixes):
            raise ValueError(f"at most {PREFIX_MAX} file prefixes of at most {PREFIX_LEN} bytes")
        self.host, self.resolver, self.prefixes = host, resolver, tuple(prefixes)
        self.programs: dict[str, object] = {}        # interpreter object path -> BPF
        self.pids: dict[int, tuple[str, dict, bool]] = {}  # pid -> (object path, probe offsets, entry fires)
        self.unavailable: dict[int, str] = {}        # pid -> why it is not traced
        self.enabled = dict.fromkeys(FAMILIES, True)
        self._fds: dict[tuple[int, str], list[int]] = {}
        self._clock = DutyClock(FAMILIES)
        self._names: dict[tuple, str] = {}           # (path, pid, file, name) -> "module:function"
        self._prev: dict[str, dict] = {"funcs": {}, "gc_count": {}, "gc_ns": {}, "lost": {}}
        self._last_ns = time.time_ns()

    _identity = KernelTracer._identity

    # ---- the tracer contract ----
    def families(self) -> dict[str, str]:
        return dict(FAMILIES)

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

    def remove_pid(self, pid: int) -> None:
        self._detach_pid(int(pid))
        self.pids.pop(int(pid), None)

    def set_family_enabled(self, family: str, on: bool) -> None:
        if family not in FAMILIES:
            raise KeyError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
        if self.enabled[family] == on:
            return
        self.enabled[family] = on
        for pid in list(self.pids):
            try:
                self._attach(pid, family) if on else self._detach(pid, family)
            except OSError as e:  # the process exited between polls
                log.debug("python tracer: pid %d family %s: %s", pid, family, e)
        if family == "functions" and not on:
            for bpf in self.programs.values():
                bpf[b"stacks"].clear()  # frames entered now will return unseen
        self._clock.set(family, on)

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
        frac = self._clock.fractions(interval)
        funcs, gc_count, gc_ns, lost = {}, {}, {}, {}
        for path, bpf in self.programs.items():
            for k, v in bpf[b"fstats"].items():
                if not v.skip:
                    funcs[(path, k.pid, k.file, k.name)] = (v.returns, v.ns)
            for k, v in bpf[b"gc"].items():
                gc_count[(path, k.value)], gc_ns[(path, k.value)] = v.count, v.ns
            lost.update({(path, k.value): v.value for k, v in bpf[b"lost"].items()})
        rows = self._function_rows(funcs, frac["functions"])
        for metric, name, cur in (("python.gc_count", "gc_count", gc_count), ("python.gc_ns", "gc_ns", gc_ns)):
            rows += [(metric, "all", d, k[1], frac["gc"]) for k, d in diff(self._prev[name], cur).items()]
            self._prev[name] = cur
        rows += [("python.lost_events", "all", d, k[1], 1.0) for k, d in diff(self._prev["lost"], lost).items()]
        self._prev["lost"] = lost
        for pid in [p for p in self.pids if not os.path.exists(f"/proc/{p}")]:
            self._forget(pid)  # it exited: its last deltas are in this batch
        return traced_batch(self.source, self.host, rows, now_ns, interval, self._identity) if rows else None

    def close(self) -> None:
        for pid in list(self.pids):
            self.remove_pid(pid)
        programs, self.programs = self.programs, {}
        for bpf in programs.values():
            bpf.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

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
        if (pid, family) in self._fds:
            return
        path, offsets, entry_fires = self.pids[pid]
        bpf = self.programs[path]
        fds: list[int] = []
        self._fds[(pid, family)] = fds
        for probe, fn in FAMILY_PROBES[family]:
            if probe == "function__entry" and not entry_fires:
                continue  # never reached: attaching it would only raise its semaphore
            off, sem = offsets[probe]
            fds.append(attach_uprobe_fd(bpf.load_func(fn.encode(), bpf.KPROBE).fd, path, off, pid, sem))

    def _detach(self, pid: int, family: str) -> None:
        close_all(self._fds.pop((pid, family), ()))  # the kernel removes the probes, lowers the semaphores

    def _detach_pid(self, pid: int) -> None:
        for fam in FAMILIES:
            self._detach(pid, fam)

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

    def _function_rows(self, funcs: dict, frac: float) -> list[tuple]:
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
                rows.append(("python.calls", dev, dc, pid, frac))
                if timed:
                    rows.append(("python.func_ns", dev, dn, pid, frac))
        return rows
