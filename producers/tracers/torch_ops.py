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

Family "collectives" (always on): how long a rank waits for its peers in
torch.distributed's gloo backend (CPU jobs, where no NCCL tracer sees the
straggler). Probes, from libtorch_cpu.so's dynamic symbol table (exported, so
present in stripped builds too), matched by demangled name:
- gloo::transport::<tcp|...>::UnboundBuffer::waitRecv / waitSend: where
  gloo's collective algorithms (ring allreduce, ...) block on gloo's worker
  threads until a peer's data has arrived or been taken. The straggler's
  peers wait here; the straggler itself finds its peers' data ready. DDP's
  bucketed allreduces also go through these.
- c10d::Work::wait: where the caller of a synchronous collective
  (dist.all_reduce(t), work.wait()) waits for it. DDP waits on futures
  instead, so this one stays quiet under DDP.
They fire per chunk of a collective, not per op: on the 3-rank test job one
64 KB all_reduce made 8 waitRecv + 8 waitSend + 1 Work::wait per rank (33
probe hits, entry and return), a 16 MB one about 48 waits; at 6-12 us a hit
that is well under a millisecond per collective. Rows per pid and kind (device "recv", "send",
"work"): torch.comm_wait_calls and torch.comm_wait_ns (deltas; a measured 0
while attached, so a rank with no collectives is not mistaken for one
without the probes), torch.comm_wait_max_ns (a gauge: the longest single wait
of the interval). A process without libtorch_cpu.so or without these
symbols gets no rows; `family_unavailable[pid]` says why.
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
import time

from fleetscope.wire import Batch
from fleetscope.producers.tracers.discovery import find_library
from fleetscope.producers.tracers.duty import DutyClock
from fleetscope.producers.tracers.kernel import BPF_DIR, TracerUnavailable
from fleetscope.producers.tracers.linked import LinkedFamilyTracer
from fleetscope.producers.tracers.rows import diff, metric_batch
from fleetscope.producers.tracers.uprobes import Link, LinkSet, check_host, file_offset, load_multi_program

log = logging.getLogger(__name__)

LIBRARY = re.compile(r"/libtorch_python\.so$")
CPU_LIBRARY = re.compile(r"/libtorch_cpu\.so$")
FAMILIES = {"ops": "expensive", "collectives": "always"}
FAMILY_INDEX = {"ops": 0, "collectives": 1}  # index into the BPF `hits` array
COMM_KINDS = ("recv", "send", "work")  # the collectives' BPF cookie is an index into this
_COMM_SYMBOL = re.compile(r"^(?:gloo::transport::\w+::UnboundBuffer::wait(Recv|Send)|c10d::Work::wait)\(")
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
_symbol_cache: dict[tuple, list] = {}  # (purpose, library file identity) -> [(vaddr, op name or kind index)]


def _functions(path: str, dynamic: bool, fragments: tuple[str, ...]) -> list[tuple[int, str]]:
    """(address, demangled name) of the functions `path` defines (its dynamic symbol table if `dynamic`, else
    its full one) whose mangled name contains one of `fragments`."""
    try:
        nm = subprocess.run(["nm", "--defined-only", *(["-D"] if dynamic else []), path], capture_output=True,
                            text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise TracerUnavailable(f"cannot read the symbols of {path} with nm ({e}); install binutils") from e
    picked = []
    for line in nm.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in "tTwW" and not parts[2].endswith(".cold") and \
                any(f in parts[2] for f in fragments):
            picked.append((int(parts[0], 16), parts[2]))
    if not picked:
        return []
    try:
        demangled = subprocess.run(["c++filt"], input="\n".join(m for _, m in picked), capture_output=True,
                                   text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError) as e:
        raise TracerUnavailable(f"c++filt failed ({e}); install binutils") from e
    return [(addr, name) for (addr, _), name in zip(picked, demangled)]


def _cached(purpose: str, path: str, build):
    st = os.stat(path)
    key = (purpose, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _symbol_cache:
        _symbol_cache[key] = build()
    return _symbol_cache[key]


def op_symbols(path: str) -> list[tuple[int, str]]:
    """(address in the library, op name) of every op wrapper in a libtorch_python, demangled; cached per file."""
    def build():
        ops = []
        for addr, name in _functions(path, False, ("THPVariable_", "THPEngine_run_backward")):
            m = _WRAPPER.search(name)
            if m:
                ops.append((addr, m.group(1)))
            elif "THPEngine_run_backward(" in name:
                ops.append((addr, "backward"))
        return ops
    ops = _cached("ops", path, build)  # an empty answer is cached too: a poll retrying the pid reads nothing again
    if not ops:
        raise TracerUnavailable(f"{path} has no THPVariable_* op wrappers in its symbol table "
                                "(a stripped build?); the torch op tracer cannot name ops there")
    return ops


def comm_symbols(path: str) -> list[tuple[int, int]]:
    """(address in the library, index into COMM_KINDS) of the gloo/c10d wait functions a libtorch_cpu exports,
    matched by demangled name; cached per file."""
    def build():
        found: dict[int, int] = {}
        for addr, name in _functions(path, True, ("UnboundBuffer", "4c10d4Work4wait")):
            m = _COMM_SYMBOL.match(name)
            if m:
                found.setdefault(addr, COMM_KINDS.index(m.group(1).lower() if m.group(1) else "work"))
        return sorted(found.items())
    syms = _cached("collectives", path, build)
    if not syms:
        raise TracerUnavailable(
            f"{path} exports none of gloo::transport::*::UnboundBuffer::waitRecv/waitSend or "
            "c10d::Work::wait (a torch build without distributed/gloo?); no collective wait for this process")
    return syms


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
        self._prog = {fn: load_multi_program(self.bpf, fn, "torch op")
                      for fn in ("op_entry", "op_return", "comm_entry", "comm_return")}
        self.op_names: list[str] = sorted(self.ops)  # the BPF cookie is an index into this
        # pid -> {family: (lib, file offsets, cookies)}, for the families the process has probes for
        self.pids: dict[int, dict[str, tuple[str, list[int], list[int]]]] = {}
        self.unavailable: dict[int, str] = {}  # pid -> why no family traces it
        self.family_unavailable: dict[int, dict[str, str]] = {}  # traced pid -> {family it lacks: why}
        self.enabled = dict.fromkeys(FAMILIES, True)
        self.links = LinkSet()  # (pid, family) -> the entry and return links
        self._clock = DutyClock(FAMILIES)
        self._prev: dict[str, dict] = {"calls": {}, "ns": {}, "lost": {}, "comm": {}}
        self._last_ns = time.time_ns()

    def add_pid(self, pid: int) -> bool:
        """Trace every family the process has probes for; False (reasons in `unavailable`) if it has none."""
        pid = int(pid)
        if pid in self.pids:
            return True
        targets, why = {}, {}
        for family, find in (("ops", self._op_probes), ("collectives", self._comm_probes)):
            try:
                targets[family] = find(pid)
            except (TracerUnavailable, OSError, ValueError) as e:
                why[family] = str(e)
        if targets:
            self.pids[pid] = targets
            try:
                for family in targets:
                    if self.enabled[family]:
                        self._attach(pid, family)
            except OSError as e:  # it exited, or the kernel refused
                self._detach_pid(pid)
                self.pids.pop(pid, None)
                targets, why = {}, {"all": str(e)}
        if not targets:
            self.unavailable[pid] = "; ".join(f"{family}: {reason}" for family, reason in why.items())
            self.family_unavailable.pop(pid, None)
            log.warning("torch tracer: not tracing pid %d: %s", pid, self.unavailable[pid])
            return False
        self.unavailable.pop(pid, None)
        self.family_unavailable[pid] = why
        for family, reason in why.items():
            log.info("torch tracer: pid %d without family %s: %s", pid, family, reason)
        return True

    def _op_probes(self, pid: int) -> tuple[str, list[int], list[int]]:
        lib = find_library(pid, LIBRARY)
        if lib is None:
            raise TracerUnavailable(f"pid {pid} does not map libtorch_python.so (not a PyTorch process, "
                                    "or torch not imported yet)")
        syms = [(a, op) for a, op in op_symbols(lib) if op in self.ops]
        return lib, [file_offset(lib, a) for a, _ in syms], [self.op_names.index(op) for _, op in syms]

    def _comm_probes(self, pid: int) -> tuple[str, list[int], list[int]]:
        lib = find_library(pid, CPU_LIBRARY)
        if lib is None:
            raise TracerUnavailable(f"pid {pid} does not map libtorch_cpu.so (not a PyTorch process, "
                                    "or torch not imported yet)")
        syms = comm_symbols(lib)
        return lib, [file_offset(lib, a) for a, _ in syms], [kind for _, kind in syms]

    def hits(self) -> dict[str, int]:
        h = self.bpf[b"hits"]
        return {family: int(sum(h.getvalue(h.Key(i)))) for family, i in FAMILY_INDEX.items()}

    def sample(self, now_ns: int | None = None) -> Batch | None:
        now_ns = time.time_ns() if now_ns is None else int(now_ns)
        interval = max(now_ns - self._last_ns, 0)
        self._last_ns = now_ns
        fracs = self._clock.fractions()
        frac = fracs["ops"]
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
        rows += self._comm_rows(interval, fracs["collectives"])
        lost = {k.value: v.value for k, v in self.bpf[b"lost"].items()}
        rows += [("torch.lost_events", "all", d, pid, interval, 1.0)
                 for pid, d in diff(self._prev["lost"], lost).items()]
        self._prev["lost"] = lost
        for pid in [p for p in self.pids if not os.path.exists(f"/proc/{p}")]:
            self._forget(pid)  # it exited: its last deltas are in this batch
        return metric_batch(self.source, self.host, rows, now_ns, interval, self._identity) if rows else None

    def _comm_rows(self, interval: int, frac: float) -> list[tuple]:
        """torch.comm_wait_calls / _ns deltas per (pid, kind), a measured 0 for every attached probe without
        waits; torch.comm_wait_max_ns, the interval's longest wait (the BPF maximum is emptied as it is read)."""
        cur = {(k.pid, k.kind): (v.calls, v.ns) for k, v in self.bpf[b"comm_waits"].items()}
        prev, self._prev["comm"] = self._prev["comm"], cur
        keys = {(pid, kind) for pid, fams in self.pids.items() if (pid, "collectives") in self.links
                for kind in fams["collectives"][2]}
        keys.update(k for k, v in cur.items() if v != prev.get(k))
        rows = []
        for pid, kind in sorted(keys):
            (c, t), (pc, pt) = cur.get((pid, kind), (0, 0)), prev.get((pid, kind), (0, 0))
            if c < pc:  # re-created: count it whole
                pc = pt = 0
            rows += [("torch.comm_wait_calls", COMM_KINDS[kind], c - pc, pid, interval, frac),
                     ("torch.comm_wait_ns", COMM_KINDS[kind], t - pt, pid, interval, frac)]
        rows += [("torch.comm_wait_max_ns", COMM_KINDS[k.kind], getattr(v, "value", v), k.pid, 0, 1.0)
                 for k, v in self.bpf[b"comm_max"].items_lookup_and_delete_batch()]
        return rows

    def close(self) -> None:
        for pid in list(self.pids):
            self.remove_pid(pid)
        bpf, self.bpf = getattr(self, "bpf", None), None
        if bpf is not None:
            bpf.cleanup()

    def _family_detached(self, family: str) -> None:
        # calls entered now will return unseen
        self.bpf[b"stacks" if family == "ops" else b"comm_starts"].clear()

    def _attach(self, pid: int, family: str) -> None:
        if family not in self.pids[pid]:
            return  # this process has no probes of the family (see family_unavailable)
        lib, offsets, cookies = self.pids[pid][family]
        entry, ret = ("op_entry", "op_return") if family == "ops" else ("comm_entry", "comm_return")
        self.links.attach((pid, family), [Link(self._prog[entry], lib, tuple(offsets), tuple(cookies)),
                                          Link(self._prog[ret], lib, tuple(offsets), tuple(cookies),
                                               retprobe=True)], pid)

    def remove_pid(self, pid: int) -> None:
        super().remove_pid(pid)
        self.family_unavailable.pop(int(pid), None)

    def _forget(self, pid: int) -> None:
        self.remove_pid(pid)
        for name in (b"ops", b"comm_waits", b"comm_max"):
            table = self.bpf[name]
            for k in [k for k in table.keys() if k.pid == pid]:
                table.pop(k, None)
        lost = self.bpf[b"lost"]
        lost.pop(lost.Key(pid), None)
        for prev in self._prev.values():
            for k in [k for k in prev if (k[0] if isinstance(k, tuple) else k) == pid]:
                del prev[k]
