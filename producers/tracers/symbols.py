"""Code addresses in a traced process -> function names, from ELF symbol tables.

cudaLaunchKernel receives the host-side stub of a kernel (nvcc emits one per
__global__ function, named like the kernel). Its address is looked up in
/proc/<pid>/maps, turned into a virtual address of the mapped object through
the object's PT_LOAD segments, and named from .symtab (else .dynsym).
Objects are parsed once per build-id (a pip wheel's libtorch shared by eight
ranks is read once); names are demangled through libstdc++'s __cxa_demangle
when it is present. Each pid gets at most `cap` distinct names; later ones
become "other", so a job with endless generated kernels cannot blow up the
metric cardinality downstream.

Pure Python (struct + numpy): pyelftools is not a dependency.
"""
from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import logging
import os
import struct
from dataclasses import dataclass

import numpy as np

from fleetscope.producers.tracers.discovery import host_path

log = logging.getLogger(__name__)

OTHER = "other"
_SYM = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
                 ("value", "<u8"), ("size", "<u8")])
_SHT_SYMTAB, _SHT_DYNSYM, _PT_LOAD, _NT_GNU_BUILD_ID, _STT_FUNC = 2, 11, 1, 3, 2


@dataclass
class ElfSymbols:
    build_id: str
    loads: list[tuple[int, int, int]]  # (p_offset, p_vaddr, p_filesz)
    starts: list[int]                   # sorted function addresses
    sizes: list[int]
    names: list[str]

    def file_offset_to_vaddr(self, off: int) -> int | None:
        for p_off, p_vaddr, p_filesz in self.loads:
            if p_off <= off < p_off + p_filesz:
                return off - p_off + p_vaddr
        return None

    def lookup(self, vaddr: int) -> str | None:
        i = bisect.bisect_right(self.starts, vaddr) - 1
        if i >= 0 and (vaddr < self.starts[i] + self.sizes[i] or (self.sizes[i] == 0 and vaddr == self.starts[i])):
            return self.names[i]
        return None


def _build_id(data: bytes, phdrs: list[tuple]) -> str:
    for p_type, p_off, p_filesz in ((p[0], p[1], p[4]) for p in phdrs):
        if p_type != 4:  # PT_NOTE
            continue
        pos, end = p_off, p_off + p_filesz
        while pos + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", data, pos)
            name_end = pos + 12 + ((namesz + 3) & ~3)
            if ntype == _NT_GNU_BUILD_ID and data[pos + 12:pos + 12 + namesz].rstrip(b"\0") == b"GNU":
                return data[name_end:name_end + descsz].hex()
            pos = name_end + ((descsz + 3) & ~3)
    return ""


def parse_elf(data: bytes) -> ElfSymbols:
    """Function symbols and load segments of a 64-bit little-endian ELF image."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF object")
    e_phoff, e_shoff = struct.unpack_from("<QQ", data, 32)
    e_phentsize, e_phnum, e_shentsize, e_shnum = struct.unpack_from("<HHHH", data, 54)
    phdrs = [struct.unpack_from("<IIQQQQ", data, e_phoff + i * e_phentsize) for i in range(e_phnum)]
    # (p_type, p_flags, p_offset, p_vaddr, p_paddr, p_filesz)
    loads = [(p[2], p[3], p[5]) for p in phdrs if p[0] == _PT_LOAD]
    build_id = _build_id(data, [(p[0], p[2], p[3], p[4], p[5]) for p in phdrs])
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize) for i in range(e_shnum)]
    # (name, type, flags, addr, offset, size, link, info, addralign, entsize)
    table = next((s for s in sections if s[1] == _SHT_SYMTAB), None) or \
        next((s for s in sections if s[1] == _SHT_DYNSYM), None)
    starts, sizes, names = [], [], []
    if table is not None:
        syms = np.frombuffer(data, dtype=_SYM, count=table[5] // _SYM.itemsize, offset=table[4])
        syms = syms[((syms["info"] & 0xF) == _STT_FUNC) & (syms["value"] != 0)]
        syms = syms[np.argsort(syms["value"], kind="stable")]
        strtab = sections[table[6]]
        base = strtab[4]
        for s in syms:
            at = base + int(s["name"])
            names.append(data[at:data.index(b"\0", at)].decode(errors="replace"))
        starts, sizes = syms["value"].tolist(), syms["size"].tolist()
    return ElfSymbols(build_id, loads, starts, sizes, names)


def _demangler():
    path = ctypes.util.find_library("stdc++")
    if not path:
        return None
    try:
        fn = ctypes.CDLL(path).__cxa_demangle
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    free = ctypes.CDLL(None).free
    free.argtypes = [ctypes.c_void_p]

    def demangle(name: str) -> str:
        if not name.startswith("_Z"):
            return name
        status = ctypes.c_int()
        out = fn(name.encode(), None, None, ctypes.byref(status))
        if status.value != 0 or not out:
            return name
        text = ctypes.string_at(out).decode(errors="replace")
        free(out)
        return text
    return demangle


_DEMANGLE = _demangler()


class Symbolizer:
    """Names for code addresses, per pid, capped at `cap` distinct names per pid."""

    def __init__(self, cap: int = 256, demangle: bool = True):
        self.cap = cap
        self.demangle = demangle and _DEMANGLE is not None
        self._by_build: dict[str, ElfSymbols] = {}   # build-id (or path+inode) -> symbols
        self._by_file: dict[tuple, ElfSymbols] = {}  # (dev, inode, mtime) -> symbols
        self._maps: dict[int, list[tuple[int, int, int, str]]] = {}
        self._names: dict[int, dict[int, str]] = {}  # pid -> addr -> name given
        self.parse_errors = 0

    def name(self, pid: int, addr: int) -> str:
        given = self._names.setdefault(pid, {})
        if addr in given:
            return given[addr]
        raw = self.resolve(pid, addr)
        label = raw if raw is not None else f"0x{addr:x}"
        if label not in given.values() and len(set(given.values())) >= self.cap:
            label = OTHER
        given[addr] = label
        return label

    def resolve(self, pid: int, addr: int) -> str | None:
        """The function at `addr` in `pid`, uncapped, or None."""
        mapping = self._mapping(pid, addr, refresh=False) or self._mapping(pid, addr, refresh=True)
        if mapping is None:
            return None
        start, _, offset, path = mapping
        elf = self._elf(pid, path)
        if elf is None:
            return None
        vaddr = elf.file_offset_to_vaddr(addr - start + offset)
        found = elf.lookup(vaddr) if vaddr is not None else None
        return _DEMANGLE(found) if found and self.demangle else found

    def prime(self, pid: int) -> None:
        """Read the pid's maps now, so its addresses still resolve after it exits."""
        self._mapping(pid, 0, refresh=True)

    def forget(self, pid: int) -> None:
        self._maps.pop(pid, None)
        self._names.pop(pid, None)

    def _mapping(self, pid: int, addr: int, refresh: bool):
        if refresh or pid not in self._maps:
            fresh = _read_maps(pid)
            if fresh or pid not in self._maps:  # a process that exited keeps its last known maps
                self._maps[pid] = fresh
        for m in self._maps[pid]:
            if m[0] <= addr < m[1]:
                return m
        return None

    def _elf(self, pid: int, path: str) -> ElfSymbols | None:
        real = host_path(pid, path)
        try:
            st = os.stat(real)
        except OSError:
            return None
        key = (st.st_dev, st.st_ino, st.st_mtime_ns)
        if key in self._by_file:
            return self._by_file[key]
        try:
            with open(real, "rb") as f:
                data = f.read()
            elf = parse_elf(data)
        except (OSError, ValueError, struct.error, IndexError) as e:
            self.parse_errors += 1
            log.warning("cannot read symbols of %s (pid %d): %s", path, pid, e)
            self._by_file[key] = None
            return None
        elf = self._by_build.setdefault(elf.build_id or f"{key}", elf)
        self._by_file[key] = elf
        return elf


def _read_maps(pid: int) -> list[tuple[int, int, int, str]]:
    out = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and "x" in parts[1] and parts[5].startswith("/"):
                    lo, hi = parts[0].split("-")
                    out.append((int(lo, 16), int(hi, 16), int(parts[2], 16), parts[5].rstrip("\n")))
    except OSError:
        pass
    return out
