"""A function's return instructions, found by disassembly: where to see it return without a uretprobe.

Why not a uretprobe: it replaces the return address on the stack with a
trampoline. A C++ exception that unwinds through the probed function makes
the unwinder look up that trampoline, find no unwind info, and call
std::terminate: the traced process dies with SIGABRT (reproduced on Linux
6.18 with gloo-named functions that throw, tests/test_return_probe_safety.py).
A plain uprobe on each `ret` of the function replaces nothing: a call that
returns normally hits one of them; one that leaves by an exception hits none
and its entry stays unpaired (the BPF side counts those).

What is not seen:
- a function that leaves by a tail call (`jmp` to another function) has no
  `ret` on that path; such jumps are counted (`tail_calls`) so the tracer can
  say the function's time is not measured on that path;
- `ret`s in the function's outlined `.cold` part (GCC moves unlikely paths
  there; they end in a throw or jump back into the hot part, whose `ret` is
  probed), because the dynamic symbol table gives the hot part's size only.

Disassembly is `objdump -d` over the function's byte range (address and size
from `nm -S`); each library file is read once per agent (the cache key is the
file's identity). On the 434 MB libtorch_cpu.so of torch 2.13 one function
takes about 1 s of objdump time (measured), paid once per library file.
"""
from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

from fleetscope.producers.tracers.kernel import TracerUnavailable

# "  8b9c7a7:\tret" / "repz ret" / "bnd ret" / "ret $0x8" (objdump --no-show-raw-insn, AT&T syntax)
_RET = re.compile(r"^\s*([0-9a-f]+):\s+(?:(?:rep[nz]?|bnd|notrack)\s+)*retq?\b")
_JMP = re.compile(r"^\s*([0-9a-f]+):\s+(?:(?:bnd|notrack)\s+)*jmpq?\s+(\*?)([0-9a-f]*)\s*(<[^>]*>)?")
_cache: dict[tuple, "ReturnSites"] = {}


@dataclass(frozen=True)
class ReturnSites:
    rets: tuple[int, ...]  # virtual addresses of the function's return instructions
    tail_calls: int        # jumps that leave the function (direct ones out of its range, and indirect ones)


def return_sites(path: str, addr: int, size: int) -> ReturnSites:
    """The return instructions of the function at `addr` (`size` bytes) in ELF object `path`; cached per file."""
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, addr, size)
    if key not in _cache:
        _cache[key] = _disassemble(path, addr, size)
    return _cache[key]


def _disassemble(path: str, addr: int, size: int) -> ReturnSites:
    if size <= 0:
        raise ValueError(f"the function at {addr:#x} in {path} has no size in the symbol table; "
                         "its return instructions cannot be found")
    try:
        text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", f"--start-address={addr:#x}",
                               f"--stop-address={addr + size:#x}", path], capture_output=True, text=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise TracerUnavailable(f"cannot disassemble {path} with objdump ({e}); install binutils") from e
    return parse_objdump(text, addr, size)


def parse_objdump(text: str, addr: int, size: int) -> ReturnSites:
    """Return instructions and leaving jumps in objdump's listing of the range [addr, addr + size)."""
    rets, tail_calls = [], 0
    for line in text.splitlines():
        m = _RET.match(line)
        if m:
            rets.append(int(m.group(1), 16))
            continue
        m = _JMP.match(line)
        if m:
            indirect, target, label = m.group(2), m.group(3), m.group(4) or ""
            if indirect:
                tail_calls += 1  # a jump table inside the function, or a call through a pointer: assume it leaves
            elif target and not addr <= int(target, 16) < addr + size and ".cold" not in label:
                tail_calls += 1
    return ReturnSites(tuple(rets), tail_calls)
