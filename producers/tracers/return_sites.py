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
  `ret` on that path; jumps out of the function's range are counted
  (`jumps_out`: tail calls, and jumps into its outlined `.cold` part) so the
  tracer can say the function's time may go unmeasured on those paths;
- `ret`s in the `.cold` part (GCC moves unlikely paths there; they end in a
  throw or jump back into the hot part, whose `ret` is probed), because the
  dynamic symbol table gives the hot part's size only.

Disassembly: the function's bytes (address and size from `nm -S`, file
offset from the load segments) are copied to a scratch file and decoded by
`objdump -D -b binary -m i386:x86-64`: objdump's own x86 decoder, without a
hand-written one. Measured on the 434 MB libtorch_cpu.so of torch 2.13: 5 ms
a function this way, against 1.6 s a function for `objdump -d
--start-address/--stop-address` on the library, which reads its whole symbol
table each time. Results are cached per library file identity and function.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

from fleetscope.producers.tracers.kernel import TracerUnavailable
from fleetscope.producers.tracers.uprobes import file_offset

# " 8b9c7a7:\tret" / "repz ret" / "bnd ret" / "ret $0x8" (objdump --no-show-raw-insn, AT&T syntax)
_RET = re.compile(r"^\s*([0-9a-f]+):\s+(?:(?:rep[nz]?|bnd|notrack)\s+)*retq?\b")
# " 8b9c7b9:\tjmp    0x8b9c78a" / "jmp *%rax" / "bnd jmp 0x4000"
_JMP = re.compile(r"^\s*([0-9a-f]+):\s+(?:(?:bnd|notrack)\s+)*jmpq?\s+(\*?)(?:0x)?([0-9a-f]*)")
_cache: dict[tuple, "ReturnSites"] = {}


@dataclass(frozen=True)
class ReturnSites:
    rets: tuple[int, ...]  # virtual addresses of the function's return instructions
    jumps_out: int         # jumps that may leave it without a ret: direct ones out of its range, indirect ones


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
    if os.uname().machine != "x86_64":
        raise TracerUnavailable(f"finding return instructions is implemented for x86_64 only, not "
                                f"{os.uname().machine}; the torch collectives family cannot run here")
    with open(path, "rb") as f:
        f.seek(file_offset(path, addr))
        code = f.read(size)
    with tempfile.NamedTemporaryFile(prefix="fleetscope-fn-", suffix=".bin") as scratch:
        scratch.write(code)
        scratch.flush()
        try:
            text = subprocess.run(["objdump", "-D", "-b", "binary", "-m", "i386:x86-64", "--no-show-raw-insn",
                                   f"--adjust-vma={addr:#x}", scratch.name], capture_output=True, text=True,
                                  check=True).stdout
        except (OSError, subprocess.CalledProcessError) as e:
            raise TracerUnavailable(f"cannot disassemble {path} with objdump ({e}); install binutils") from e
    return parse_objdump(text, addr, size)


def parse_objdump(text: str, addr: int, size: int) -> ReturnSites:
    """Return instructions and leaving jumps in objdump's listing of the range [addr, addr + size)."""
    rets, jumps_out = [], 0
    for line in text.splitlines():
        m = _RET.match(line)
        if m:
            rets.append(int(m.group(1), 16))
            continue
        m = _JMP.match(line)
        if m:
            indirect, target = m.group(2), m.group(3)
            if indirect:
                jumps_out += 1  # a jump table inside the function, or a call through a pointer: assume it leaves
            elif target and not addr <= int(target, 16) < addr + size:
                jumps_out += 1
    return ReturnSites(tuple(rets), jumps_out)
