"""Attaching uprobes per process, as the CUDA, NCCL, Python and torch tracers all do.

Every probe family of a process is attached as uprobe_multi BPF links (one
link per BPF program, library and process; each probe in it carries a BPF
cookie the program reads back, e.g. the API or op index). Why links:
removing a uprobe waits for a kernel grace period (~0.1 s on our VMs). A
single-probe perf event pays that wait per probe (126 torch probes: 16 s to
detach), a link pays it once for all its probes, and links closed together
(`LinkSet.detach`, concurrent closes) share the wait. Duty-cycling a family
is then a few fds opened or closed.

USDT semaphores: a link may pass `ref_ctr_offsets` (each probe's semaphore
file offset); the kernel raises the process's semaphore while the probe is
installed and lowers it when the link goes, even if the process exits.

`attach_uprobe_fd` (one perf-event uprobe) remains for measurements that
compare the two mechanisms (benchmarks/toggle_cost_bench.py).
"""
from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fleetscope.producers.tracers.kernel import TracerUnavailable

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_NR_PERF_EVENT_OPEN, _NR_BPF = 298, 321  # x86_64
_PERF_EVENT_IOC_ENABLE, _PERF_EVENT_IOC_SET_BPF = 0x2400, 0x40042408
_PERF_FLAG_FD_CLOEXEC = 8
BPF_TRACE_UPROBE_MULTI, _BPF_LINK_CREATE = 48, 28


def check_host(what: str) -> None:
    """Raise TracerUnavailable unless this process can load BPF programs and attach uprobes."""
    if os.geteuid() != 0:
        raise TracerUnavailable(f"the {what} tracer loads BPF programs and needs root (or CAP_BPF+CAP_PERFMON): "
                                "run the agent as root or in a privileged container")
    try:
        import bcc  # noqa: F401  Debian's python3-bpfcc; the PyPI "bcc" is unrelated
    except ImportError as e:
        raise TracerUnavailable(f"bcc is not importable ({e}): install Debian's python3-bpfcc "
                                "and run install.sh, which links it into the venv") from e
    uprobe_pmu_type()


def uprobe_pmu_type() -> int:
    try:
        with open("/sys/bus/event_source/devices/uprobe/type") as f:
            return int(f.read())
    except OSError as e:
        raise TracerUnavailable(f"this kernel has no uprobe PMU ({e}); uprobe and USDT tracing need uprobes") from e


def load_multi_program(bpf, fn: str, what: str) -> int:
    """The fd of BPF function `fn` loaded for uprobe_multi links (Linux 6.6 or later)."""
    try:
        return bpf.load_func(fn.encode(), bpf.KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI).fd
    except Exception as e:  # bcc raises bare Exception when the kernel refuses the program
        raise TracerUnavailable(f"this kernel cannot load uprobe_multi programs ({e}); the {what} tracer "
                                "needs Linux 6.6 or later") from e


def attach_uprobe_multi(prog_fd: int, path: str, offsets, cookies, pid: int, retprobe: bool = False,
                        ref_ctr_offsets=None) -> int:
    """One uprobe_multi link: `prog_fd` at every file offset of `path` in process `pid`, each probe with
    its BPF cookie (and USDT semaphore offset, if given). Close the fd to detach."""
    n = len(offsets)
    c_path = ctypes.create_string_buffer(path.encode())
    c_offsets = (ctypes.c_uint64 * n)(*offsets)
    c_cookies = (ctypes.c_uint64 * n)(*cookies)
    c_refs = (ctypes.c_uint64 * n)(*ref_ctr_offsets) if ref_ctr_offsets else None
    attr = ctypes.create_string_buffer(128)
    struct.pack_into("<IIII", attr, 0, prog_fd, 0, BPF_TRACE_UPROBE_MULTI, 0)
    struct.pack_into("<QQQQIII", attr, 16, ctypes.addressof(c_path), ctypes.addressof(c_offsets),
                     ctypes.addressof(c_refs) if c_refs is not None else 0, ctypes.addressof(c_cookies), n,
                     1 if retprobe else 0, pid)
    fd = _libc.syscall(_NR_BPF, _BPF_LINK_CREATE, attr, 128)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"bpf(LINK_CREATE uprobe_multi, {n} probes in {path}, pid {pid}): {os.strerror(err)}")
    return fd


def attach_uprobe_fd(prog_fd: int, path: str, offset: int, pid: int, ref_ctr_offset: int = 0,
                     retprobe: bool = False) -> int:
    """One single-probe perf-event uprobe on `path`+`offset` in process `pid`; close the fd to detach."""
    attr = ctypes.create_string_buffer(128)
    cpath = ctypes.create_string_buffer(path.encode())
    struct.pack_into("<IIQ", attr, 0, uprobe_pmu_type(), 128, ref_ctr_offset << 32 | retprobe)
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


def close_all(fds) -> None:
    """Close probe fds concurrently: each removal waits for a grace period, concurrent ones share it."""
    fds = list(fds)
    if len(fds) <= 1:
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


def symbol_offset(path: str, symbol: str) -> int:
    """The file offset of an exported function (as a uprobe wants it); raises LookupError if absent."""
    from bcc import BPF
    try:
        return BPF._check_path_symbol(path.encode(), symbol.encode(), 0, -1)[1]
    except Exception as e:  # bcc: "could not determine address of symbol"
        raise LookupError(f"{symbol} is not a symbol of {path}") from e


@dataclass(frozen=True)
class Link:
    """What one uprobe_multi link attaches: a program at some offsets of one object file."""
    prog_fd: int
    path: str
    offsets: tuple[int, ...]
    cookies: tuple[int, ...]
    retprobe: bool = False
    ref_ctr_offsets: tuple[int, ...] | None = None
    symbols: tuple[str, ...] = ()  # the probed functions' names, one per offset (required for a retprobe link)


class UndeclaredReturnProbe(ValueError):
    """A return probe on a function its tracer has not declared safe for one (see check_return_probes)."""


def check_return_probes(links, declared: dict[str, str]) -> None:
    """Raise UndeclaredReturnProbe unless every symbol of every retprobe link fully matches a pattern in
    `declared` ({regex: why a uretprobe cannot harm the process there}).

    Why: a uretprobe replaces the return address; a C++ exception unwinding through the function then
    finds the trampoline instead and the process calls std::terminate. A return probe goes only where no
    exception can pass, and the tracer says why, per symbol."""
    for ln in links:
        if not ln.retprobe:
            continue
        if len(ln.symbols) != len(ln.offsets):
            raise UndeclaredReturnProbe(f"a return-probe link on {ln.path} names {len(ln.symbols)} symbols for "
                                        f"{len(ln.offsets)} probes; every return probe must name its function")
        for sym in ln.symbols:
            if not any(re.fullmatch(pattern, sym) for pattern in declared):
                raise UndeclaredReturnProbe(f"no return probe is declared safe for {sym!r} in {ln.path}; "
                                            "probe its return instructions instead (return_sites.py)")


class LinkSet:
    """The attached links of a tracer, grouped under keys such as (pid, family).

    `return_probes` is the tracer's RETURN_PROBES declaration; a link set refuses any return probe
    it does not cover, before touching the kernel."""

    def __init__(self, return_probes: dict[str, str]):
        self.return_probes = dict(return_probes)
        self.fds: dict[tuple, list[int]] = {}

    def __contains__(self, key) -> bool:
        return key in self.fds

    def keys(self) -> list[tuple]:
        return list(self.fds)

    def attach(self, key: tuple, links, pid: int) -> None:
        """Attach all of `links` for `pid` under `key`, or none of them (OSError: e.g. the process exited)."""
        if key in self.fds:
            return
        links = list(links)
        check_return_probes(links, self.return_probes)
        fds: list[int] = []
        try:
            for ln in links:
                if ln.offsets:
                    fds.append(attach_uprobe_multi(ln.prog_fd, ln.path, ln.offsets, ln.cookies, pid, ln.retprobe,
                                                   ln.ref_ctr_offsets))
        except OSError:
            close_all(fds)
            raise
        self.fds[key] = fds

    def detach(self, keys) -> None:
        """Detach every key in `keys` at once (one shared grace period)."""
        close_all(fd for key in list(keys) for fd in self.fds.pop(key, ()))

    def close(self) -> None:
        self.detach(self.keys())
