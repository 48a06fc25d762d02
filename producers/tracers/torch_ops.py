"""TorchTracer: PyTorch operator calls and time from uprobes on libtorch_python.

Which symbols, and why: libtorch_python.so has one C++ wrapper per op for
each Python binding (torch.mm, Tensor.mm, torch._C._nn.linear, ...), all
named torch::autograd::THPVariable_<op> (static functions, in the library's
.symtab). Probing those wrappers
- names the op by the probed address alone: one BPF program serves every op,
  keys its counters by (pid, address), and copies no string per call; user
  space maps an address to its symbol once;
- sees each op as the model's Python code calls it (nn.Linear -> "linear"),
  not the dozens of internal aten calls behind it, which keeps the hit rate
  (and the ~5 us per hit) low.
The autograd engine runs backward ops in C++, which no Python wrapper sees;
THPEngine_run_backward (the binding behind Tensor.backward) is probed as the
op "backward" and its time covers the whole backward pass. Dispatcher entry
points in libtorch_cpu (at::_ops::<op>::call) would also see internal and
backward ops but at many times the rate; they are the alternative if that
detail is worth the cost.

Symbols come from `nm` on the library the process maps (found through
/proc/<pid>/maps) and are demangled with c++filt, once per library file. A
configurable op list keeps the number of probes (2 per wrapper: entry and
return) small. Each process gets two uprobe_multi links (entry, return),
each probe carrying its op's index as BPF cookie: attaching or detaching the
family is two link fds, one kernel grace period each (single-probe perf
events took 16 s to detach 126 probes).

Rows: torch.ops (calls) and torch.op_ns (time between wrapper entry and
return) per op name, torch.lost_events; all deltas with the family's
sample_frac (family "ops", expensive: duty-cycled by the governor).
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
import time

from fleetscope.wire import Batch
from producers.tracers.discovery import find_library
from producers.tracers.duty import DutyClock
from producers.tracers.kernel import BPF_DIR, TracerUnavailable
from producers.tracers.linked import LinkedFamilyTracer
from producers.tracers.rows import diff, metric_batch
from producers.tracers.uprobes import Link, LinkSet, check_host, file_offset, load_multi_program

log = logging.getLogger(__name__)

LIBRARY = re.compile(r"/libtorch_python\.so$")
FAMILIES = {"ops": "expensive"}
# Ops probed by default: the compute, loss and optimizer ops of common
# training loops. "backward" is THPEngine_run_backward.
DEFAULT_OPS = frozenset("""
linear matmul mm bmm addmm baddbmm einsum conv1d conv2d conv3d conv_transpose2d
relu relu_ gelu silu sigmoid tanh softmax log_softmax layer_norm batch_norm group_norm rms_norm
dropout embedding scaled_dot_product_attention mse_loss cross_entropy_loss nll_loss
binary_cross_entropy_with_logits add add_ mul mul_ sum mean cat stack
_foreach_add_ _foreach_mul_ _foreach_lerp_ _foreach_addcmul_ _foreach_addcdiv_ _foreach_sqrt
_fused_adam_ _fused_adamw_ _fused_sgd_ backward
""".split())
_WRAPPER = re.compile(r"THPVariable_(\w+)\(")
_symbol_cache: dict[tuple, list[tuple[int, str]]] = {}  # library file identity -> [(vaddr, op)]


def op_symbols(path: str) -> list[tuple[int, str]]:
    """(address in the library, op name) of every op wrapper in a libtorch_python, demangled; cached per file."""
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _symbol_cache:
        try:
            nm = subprocess.run(["nm", "--defined-only", path], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError) as e:
            raise TracerUnavailable(f"cannot read the symbols of {path} with nm ({e}); install binutils") from e
        picked = []
        for line in nm.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] in "tT" and not parts[2].endswith(".cold") and \
                    ("THPVariable_" in parts[2] or "THPEngine_run_backward" in parts[2]):
                picked.append((int(parts[0], 16), parts[2]))
        if not picked:
            raise TracerUnavailable(f"{path} has no THPVariable_* op wrappers in its symbol table "
                                    "(a stripped build?); the torch op tracer cannot name ops there")
        try:
            demangled = subprocess.run(["c++filt"], input="\n".join(m for _, m in picked), capture_output=True,
                                       text=True, check=True).stdout.splitlines()
        except (OSError, subprocess.CalledProcessError) as e:
            raise TracerUnavailable(f"c++filt failed ({e}); install binutils") from e
        ops = []
        for (addr, _), name in zip(picked, demangled):
            m = _WRAPPER.search(name)
            if m:
                ops.append((addr, m.group(1)))
            elif "THPEngine_run_backward(" in name:
                ops.append((addr, "backward"))
        _symbol_cache[key] = ops
    return _symbol_cache[key]


class TorchTracer(LinkedFamilyTracer):
    FAMILIES = FAMILIES
    source = "torch"

    def __init__(self, host: str, resolver=None, ops: frozenset[str] | None = None):
        """`ops`: op names to probe (default DEFAULT_OPS); "backward" is the autograd engine entry."""
        check_host("torch op")
        from bcc import BPF
        self.host, self.resolver = host, resolver
        self.ops = frozenset(DEFAULT_OPS if ops is None else ops)
        try:
            self.bpf = BPF(src_file=str(BPF_DIR / "torch.bpf.c").encode(),
                           cflags=[f"-I{BPF_DIR}", "-Wno-everything"])
        except Exception as e:  # bcc raises bare Exception on compile/load failure
            raise TracerUnavailable(f"loading bpf/torch.bpf.c failed ({e}); check that kernel headers exist "
                                    f"at /lib/modules/{os.uname().release}/build") from e
        self._prog = {fn: load_multi_program(self.bpf, fn, "torch op") for fn in ("op_entry", "op_return")}
        self.op_names: list[str] = sorted(self.ops)  # the BPF cookie is an index into this
        self.pids: dict[int, tuple[str, list[int], list[int]]] = {}  # pid -> (lib, file offsets, cookies)
        self.unavailable: dict[int, str] = {}
        self.enabled = {"ops": True}
        self.links = LinkSet()  # (pid, "ops") -> the entry and return links
        self._clock = DutyClock(FAMILIES)
        self._prev: dict[str, dict] = {"calls": {}, "ns": {}, "lost": {}}
        self._last_ns = time.time_ns()

    def add_pid(self, pid: int) -> bool:
        pid = int(pid)
        if pid in self.pids:
            return True
        lib = find_library(pid, LIBRARY)
        why = None
        if lib is None:
            why = f"pid {pid} does not map libtorch_python.so (not a PyTorch process, or torch not imported yet)"
        else:
            try:
                syms = [(a, op) for a, op in op_symbols(lib) if op in self.ops]
                self.pids[pid] = (lib, [file_offset(lib, a) for a, _ in syms],
                                  [self.op_names.index(op) for _, op in syms])
                if self.enabled["ops"]:
                    self._attach(pid, "ops")
            except (TracerUnavailable, OSError, ValueError) as e:
                self._detach_pid(pid)
                self.pids.pop(pid, None)
                why = str(e)
        if why:
            self.unavailable[pid] = why
            log.warning("torch tracer: not tracing pid %d: %s", pid, why)
            return False
        self.unavailable.pop(pid, None)
        return True

    def hits(self) -> dict[str, int]:
        h = self.bpf[b"hits"]
        return {"ops": int(sum(h.getvalue(h.Key(0))))}

    def sample(self, now_ns: int | None = None) -> Batch | None:
        now_ns = time.time_ns() if now_ns is None else int(now_ns)
        interval = max(now_ns - self._last_ns, 0)
        self._last_ns = now_ns
        frac = self._clock.fractions()["ops"]
        calls, ns = {}, {}
        for k, v in self.bpf[b"ops"].items():
            calls[(k.pid, k.op)], ns[(k.pid, k.op)] = v.calls, v.ns
        per_op: dict[tuple[int, str], list[int]] = {}
        for name, cur, slot in (("calls", calls, 0), ("ns", ns, 1)):
            for (pid, op), d in diff(self._prev[name], cur).items():
                per_op.setdefault((pid, self.op_names[op]), [0, 0])[slot] += d
            self._prev[name] = cur
        rows = []
        for (pid, op), (c, t) in per_op.items():
            rows += [("torch.ops", op, c, pid, interval, frac), ("torch.op_ns", op, t, pid, interval, frac)]
        lost = {k.value: v.value for k, v in self.bpf[b"lost"].items()}
        rows += [("torch.lost_events", "all", d, pid, interval, 1.0)
                 for pid, d in diff(self._prev["lost"], lost).items()]
        self._prev["lost"] = lost
        for pid in [p for p in self.pids if not os.path.exists(f"/proc/{p}")]:
            self._forget(pid)  # it exited: its last deltas are in this batch
        return metric_batch(self.source, self.host, rows, now_ns, interval, self._identity) if rows else None

    def close(self) -> None:
        for pid in list(self.pids):
            self.remove_pid(pid)
        bpf, self.bpf = getattr(self, "bpf", None), None
        if bpf is not None:
            bpf.cleanup()

    def _family_detached(self, family: str) -> None:
        self.bpf[b"stacks"].clear()  # ops entered now will return unseen

    def _attach(self, pid: int, family: str) -> None:
        lib, offsets, cookies = self.pids[pid]
        self.links.attach((pid, "ops"), [Link(self._prog["op_entry"], lib, tuple(offsets), tuple(cookies)),
                                         Link(self._prog["op_return"], lib, tuple(offsets), tuple(cookies),
                                              retprobe=True)], pid)

    def _forget(self, pid: int) -> None:
        self.remove_pid(pid)
        ops, lost = self.bpf[b"ops"], self.bpf[b"lost"]
        for k in [k for k in ops.keys() if k.pid == pid]:
            ops.pop(k, None)
        lost.pop(lost.Key(pid), None)
        for prev in self._prev.values():
            for k in [k for k in prev if (k[0] if isinstance(k, tuple) else k) == pid]:
                del prev[k]
