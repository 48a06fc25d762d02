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

Return probes, and why they are safe where they are (RETURN_PROBES): a
uretprobe replaces the return address, and a C++ exception unwinding through
such a function makes the process call std::terminate. The op wrappers keep
uretprobes: each is a CPython method (PyObject* f(PyObject*, PyObject*,
PyObject*), checked on the demangled signature) whose body is wrapped in
HANDLE_TH_ERRORS/END_HANDLE_TH_ERRORS (torch/csrc/Exceptions.h), which
catches every std::exception inside the wrapper and turns it into a Python
error; the unwinder stops at that handler, inside the wrapper, and never
reads the replaced return address. THPEngine_run_backward is wrapped the
same way. The gloo and c10d waits below throw (timeouts, a lost peer)
through to their callers, so they get no return probe: their return is seen
by plain uprobes on each of their `ret` instructions, found by disassembly
(return_sites.py). A wait left by an exception reaches no `ret` probe; its
start is counted as unpaired at the thread's next wait of that kind
(torch.comm_wait_unpaired). A wait that leaves by a tail call is not timed
on that path either; jumps out of the waits are counted per library (`jumps_out`).

Rows: torch.ops (calls) and torch.op_ns (time between wrapper entry and
return) per op name, torch.lost_events; all deltas with the family's
sample_frac (family "ops", expensive: duty-cycled by the governor).

Family "waits" (expensive: duty-cycled by the governor): how long a rank waits for its peers in
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
Each is probed at its entry and at its `ret` instructions (never with a
uretprobe: these throw). They fire per chunk of a collective, not per op: on
the 3-rank test job one 64 KB all_reduce made 8 waitRecv + 8 waitSend + 1
Work::wait per rank (33 probe hits, entry and return), a 16 MB one about 48
waits; at 6-12 us a hit
that is well under a millisecond per collective, but on a small CPU DDP job (30 steps a second, two
collectives a step) it is the whole 1% budget, and more while the peers of a straggler wait (its CPU time
falls, the hits do not): the scenarios' dataloader stall had the always-on family shed about 10 s into its
fault, and with it the marks below, so the ranks' roles fell back to "every rank alike". So the waits
are duty-cycled like the ops (rows carry the family's sample_frac; windows scale them), and only the
marks stay always on. Rows per pid and kind (device "recv", "send",
"work"): torch.comm_wait_calls and torch.comm_wait_ns (deltas; a measured 0
while attached, so a rank with no collectives is not mistaken for one
without the probes), torch.comm_wait_max_ns (a gauge: the longest single wait
of the interval), torch.comm_wait_unpaired (waits left without reaching a
`ret`: by an exception or a tail call). A process without libtorch_cpu.so or without these
symbols gets no rows; `family_unavailable[pid]` says why.
Family "collectives" (always on) marks when each collective was issued, for who arrives last
(producers/tracers/gloo_marks.py): c10d::ProcessGroupGloo::nextTag at its
entry and at its `ret`, two hits per collective. Rows torch.coll_entry_ns
and torch.coll_issued; a libtorch_cpu that does not export nextTag gets the
waits without marks (`family_unavailable` says so).

Detail mode (detail=True: -DDETAIL, as for the CUDA and NCCL tracers; producers/tracers/detail.py): while the
BPF detail gate is open (`set_detail_until`, or for the whole run with detail_always), each op's return and
each collective wait's return also sends one per-call record through a ring buffer, and each sample() drains
them into `records`: {"api": the op name as in the rows ("mm", "linear", "backward") or the wait kind
("recv", "send", "work"), "pid", "tid", "ts_ns" (entry, epoch ns), "dur_ns", "family": "ops" or
"waits"}. The records come from the same return programs (no probe is added; the waits keep their
`ret` uprobes). A record the ring could not take counts in torch.lost_events. With the gate closed a return
pays one array lookup more; the rows count every call either way.
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
import time
from dataclasses import dataclass

from fleetscope.wire import Batch
from fleetscope.producers.tracers.discovery import find_library
from fleetscope.producers.tracers.duty import DutyClock
from fleetscope.producers.tracers.gloo_marks import NEXT_TAG, NEXT_TAG_MANGLED, GlooMarks, tag_probe_sites
from fleetscope.producers.tracers.detail import DetailRecords, detail_flags
from fleetscope.producers.tracers.kernel import BPF_DIR, TracerUnavailable
from fleetscope.producers.tracers.linked import LinkedFamilyTracer
from fleetscope.producers.tracers.return_sites import return_sites
from fleetscope.producers.tracers.rows import diff, metric_batch
from fleetscope.producers.tracers.uprobes import Link, LinkSet, check_host, file_offset, load_multi_program

log = logging.getLogger(__name__)

LIBRARY = re.compile(r"/libtorch_python\.so$")
CPU_LIBRARY = re.compile(r"/libtorch_cpu\.so$")
FAMILIES = {"ops": "expensive", "waits": "expensive", "collectives": "always"}
FAMILY_INDEX = {"ops": 0, "collectives": 1, "waits": 2}  # index into the BPF `hits` array
# per family: its entry and exit programs (bpf/torch.bpf.c) and the per-thread table that detaching
# leaves behind (calls entered then return unseen)
PROGRAMS = {"ops": ("op_entry", "op_return", b"stacks"), "waits": ("comm_entry", "comm_return", b"comm_starts"),
            "collectives": ("tag_entry", "tag_return", b"tag_calls")}
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
# A CPython method: PyObject* (PyObject* self, PyObject* args[, PyObject* kwargs]), demangled
_PY_METHOD_ARGS = r"\(_object\*(?:, _object\*){1,2}\)"
_WRAPPER = re.compile(r"(?:torch::autograd::)?THPVariable_(\w+)" + _PY_METHOD_ARGS)  # fullmatch
_BACKWARD = re.compile(r"(?:torch::autograd::(?:python::)?)?THPEngine_run_backward" + _PY_METHOD_ARGS)
_CATCHES_ALL = ("a CPython method whose body is wrapped in HANDLE_TH_ERRORS/END_HANDLE_TH_ERRORS "
                "(torch/csrc/Exceptions.h): every std::exception is caught inside it and becomes a Python "
                "error, so no exception unwinds through its return address")
_symbol_cache: dict[tuple, list] = {}  # (purpose, library file identity) -> what the symbols gave


@dataclass(frozen=True)
class FamilyProbes:
    """One family's probes in one process: entries, and where its returns are seen."""
    lib: str
    entries: tuple[int, ...]       # file offsets of the functions
    cookies: tuple[int, ...]       # per entry: op index or COMM_KINDS index
    symbols: tuple[str, ...]       # per entry: demangled name (return probes are checked against RETURN_PROBES)
    exits: tuple[int, ...] = ()    # file offsets of `ret` instructions; () means a uretprobe on each entry
    exit_cookies: tuple[int, ...] = ()


def _functions(path: str, dynamic: bool, fragments: tuple[str, ...]) -> list[tuple[int, int, str]]:
    """(address, size, demangled name) of the functions `path` defines (its dynamic symbol table if `dynamic`,
    else its full one) whose mangled name contains one of `fragments`."""
    try:
        nm = subprocess.run(["nm", "--defined-only", "-S", *(["-D"] if dynamic else []), path],
                            capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise TracerUnavailable(f"cannot read the symbols of {path} with nm ({e}); install binutils") from e
    picked = []
    for line in nm.splitlines():
        parts = line.split()
        if len(parts) == 3:  # a symbol without a size
            parts = [parts[0], "0", *parts[1:]]
        if len(parts) == 4 and parts[2] in "tTwW" and not parts[3].endswith(".cold") and \
                any(f in parts[3] for f in fragments):
            picked.append((int(parts[0], 16), int(parts[1], 16), parts[3]))
    if not picked:
        return []
    try:
        demangled = subprocess.run(["c++filt"], input="\n".join(m for _, _, m in picked), capture_output=True,
                                   text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError) as e:
        raise TracerUnavailable(f"c++filt failed ({e}); install binutils") from e
    return [(addr, size, name) for (addr, size, _), name in zip(picked, demangled)]


def _cached(purpose: str, path: str, build):
    st = os.stat(path)
    key = (purpose, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _symbol_cache:
        _symbol_cache[key] = build()
    return _symbol_cache[key]


def op_symbols(path: str) -> list[tuple[int, str, str]]:
    """(address in the library, op name, demangled symbol) of every op wrapper in a libtorch_python; cached
    per file. Only CPython methods qualify (see _CATCHES_ALL): they are what may carry a uretprobe."""
    def build():
        ops = []
        for addr, _, name in _functions(path, False, ("THPVariable_", "THPEngine_run_backward")):
            m = _WRAPPER.fullmatch(name)
            if m:
                ops.append((addr, m.group(1), name))
            elif _BACKWARD.fullmatch(name):
                ops.append((addr, "backward", name))
        return ops
    ops = _cached("ops", path, build)  # an empty answer is cached too: a poll retrying the pid reads nothing again
    if not ops:
        raise TracerUnavailable(f"{path} has no THPVariable_* op wrappers in its symbol table "
                                "(a stripped build?); the torch op tracer cannot name ops there")
    return ops


@dataclass(frozen=True)
class CommSymbols:
    waits: tuple[CommFunction, ...]
    next_tag: tuple[int, tuple[int, ...]] | None  # (address, `ret` addresses) of nextTag, where exported


@dataclass(frozen=True)
class CommFunction:
    addr: int
    kind: int                # index into COMM_KINDS
    name: str                # demangled
    rets: tuple[int, ...]    # addresses of its `ret` instructions
    jumps_out: int           # jumps that may leave it without a `ret` (not timed on such a path)


def comm_symbols(path: str) -> CommSymbols:
    """The gloo/c10d wait functions a libtorch_cpu exports, matched by demangled name, with their `ret`
    instructions (disassembled: these throw, so they get no uretprobe), and nextTag for the arrival marks;
    cached per file. A function whose every exit is a tail call has nothing to time and is left out."""
    def build():
        found: dict[int, CommFunction] = {}
        functions = _functions(path, True, ("UnboundBuffer", "4c10d4Work4wait", NEXT_TAG_MANGLED))
        for addr, size, name in functions:
            m = _COMM_SYMBOL.match(name)
            if m and addr not in found:
                sites = return_sites(path, addr, size)
                fn = CommFunction(addr, COMM_KINDS.index(m.group(1).lower() if m.group(1) else "work"), name,
                                  sites.rets, sites.jumps_out)
                if fn.jumps_out:
                    log.info("torch tracer: %s in %s has %d jump(s) out of its range (tail calls or its .cold "
                             "part); a wait leaving by one is not timed", name, path, fn.jumps_out)
                if fn.rets:
                    found[addr] = fn
                else:
                    log.warning("torch tracer: %s in %s has no ret instruction; not probed", name, path)
        return CommSymbols(tuple(found[a] for a in sorted(found)), tag_probe_sites(functions, path))
    return _cached("collectives", path, build)


class TorchTracer(DetailRecords, LinkedFamilyTracer):
    FAMILIES = FAMILIES
    source = "torch"
    # Where a uretprobe goes, and why it cannot harm the process there (checked on every return-probe link).
    # The collectives' waits throw and are not here: their returns are probed at their `ret` instructions.
    RETURN_PROBES = {_WRAPPER.pattern: _CATCHES_ALL, _BACKWARD.pattern: _CATCHES_ALL}

    def __init__(self, host: str, resolver=None, ops: frozenset[str] | None = None, detail: bool = False,
                 ring_pages: int = 1024, detail_always: bool = True):
        """`ops`: op names to probe (default DEFAULT_OPS); "backward" is the autograd engine entry. `detail`:
        per-call records while the gate is open, from construction on with `detail_always` (module doc)."""
        check_host("torch op")
        from bcc import BPF
        self.host, self.resolver = host, resolver
        self.ops = frozenset(DEFAULT_OPS if ops is None else ops)
        try:
            self.bpf = BPF(src_file=str(BPF_DIR / "torch.bpf.c").encode(),
                           cflags=[f"-I{BPF_DIR}", "-Wno-everything", *detail_flags(detail, ring_pages)])
        except Exception as e:  # bcc raises bare Exception on compile/load failure
            raise TracerUnavailable(f"loading bpf/torch.bpf.c failed ({e}); check that kernel headers exist "
                                    f"at /lib/modules/{os.uname().release}/build") from e
        self._prog = {fn: load_multi_program(self.bpf, fn, "torch op")
                      for entry, ret, _ in PROGRAMS.values() for fn in (entry, ret)}
        self.op_names: list[str] = sorted(self.ops)  # the BPF cookie is an index into this
        # pid -> {family: its probes}, for the families the process has probes for
        self.pids: dict[int, dict[str, FamilyProbes]] = {}
        self.unavailable: dict[int, str] = {}  # pid -> why no family traces it
        self.family_unavailable: dict[int, dict[str, str]] = {}  # traced pid -> {family it lacks: why}
        self.jumps_out: dict[str, int] = {}  # libtorch_cpu path -> jumps out of the waits (exits not timed)
        self.enabled = dict.fromkeys(FAMILIES, True)
        self.links = LinkSet(self.RETURN_PROBES)  # (pid, family) -> the entry and return links
        self._clock = DutyClock(FAMILIES)
        self._prev: dict[str, dict] = {"calls": {}, "ns": {}, "lost": {}, "comm": {}, "unpaired": {}}
        self._last_ns = time.time_ns()
        self._init_detail(detail, detail_always, "torch op")  # records, the gate, set_detail_until (detail.py)
        self.marks = GlooMarks(self.clock)

    def add_pid(self, pid: int) -> bool:
        """Trace every family the process has probes for; False (reasons in `unavailable`) if it has none."""
        pid = int(pid)
        if pid in self.pids:
            return True
        targets, why = {}, {}
        for family, find in (("ops", self._op_probes), ("waits", self._wait_probes),
                             ("collectives", self._mark_probes)):
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

    def _op_probes(self, pid: int) -> FamilyProbes:
        lib = find_library(pid, LIBRARY)
        if lib is None:
            raise TracerUnavailable(f"pid {pid} does not map libtorch_python.so (not a PyTorch process, "
                                    "or torch not imported yet)")
        syms = [(a, op, name) for a, op, name in op_symbols(lib) if op in self.ops]
        return FamilyProbes(lib, tuple(file_offset(lib, a) for a, _, _ in syms),
                            tuple(self.op_names.index(op) for _, op, _ in syms), tuple(n for _, _, n in syms))

    @staticmethod
    def _cpu_library(pid: int) -> tuple[str, CommSymbols]:
        lib = find_library(pid, CPU_LIBRARY)
        if lib is None:
            raise TracerUnavailable(f"pid {pid} does not map libtorch_cpu.so (not a PyTorch process, "
                                    "or torch not imported yet)")
        return lib, comm_symbols(lib)

    def _wait_probes(self, pid: int) -> FamilyProbes:
        lib, syms = self._cpu_library(pid)
        fns = syms.waits
        if not fns:
            raise TracerUnavailable(
                f"{lib} exports none of gloo::transport::*::UnboundBuffer::waitRecv/waitSend or "
                "c10d::Work::wait (a torch build without distributed/gloo?); no collective wait for this process")
        self.jumps_out[lib] = sum(f.jumps_out for f in fns)
        exits = [(ret, f.kind) for f in fns for ret in f.rets]
        return FamilyProbes(lib, tuple(file_offset(lib, f.addr) for f in fns), tuple(f.kind for f in fns),
                            tuple(f.name for f in fns), tuple(file_offset(lib, r) for r, _ in exits),
                            tuple(k for _, k in exits))

    def _mark_probes(self, pid: int) -> FamilyProbes:
        lib, syms = self._cpu_library(pid)
        if syms.next_tag is None:
            raise TracerUnavailable(f"{lib} does not export c10d::ProcessGroupGloo::nextTag (a torch build "
                                    "without gloo?); no arrival marks for this process")
        addr, rets = syms.next_tag
        return FamilyProbes(lib, (file_offset(lib, addr),), (0,), (NEXT_TAG,),
                            tuple(file_offset(lib, r) for r in rets), (0,) * len(rets))

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
        rows += self._comm_rows(interval, fracs["waits"])
        rows += self.marks.rows(self.bpf[b"coll_marks"], interval, fracs["collectives"],
                                [pid for pid in self.pids if (pid, "collectives") in self.links])
        self._drain_records()  # detail mode: this sample's records (one the ring refused counts in `lost`)
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
        stats = list(self.bpf[b"comm_waits"].items())
        cur = {(k.pid, k.kind): (v.calls, v.ns) for k, v in stats}
        unpaired = {(k.pid, k.kind): v.unpaired for k, v in stats}
        prev, self._prev["comm"] = self._prev["comm"], cur
        keys = {(pid, kind) for pid, fams in self.pids.items() if (pid, "waits") in self.links
                for kind in fams["waits"].cookies}
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
        prev_unpaired, self._prev["unpaired"] = self._prev["unpaired"], unpaired
        rows += [("torch.comm_wait_unpaired", COMM_KINDS[kind], d, pid, interval, frac)
                 for (pid, kind), d in diff(prev_unpaired, unpaired).items() if d]
        return rows

    def _on_record(self, ctx, data, size) -> None:
        ev = self.bpf[b"calls"].event(data)
        if ev.family == 0:
            api, family = self.op_names[ev.what], "ops"
        else:
            api, family = COMM_KINDS[ev.what], "waits"
        self.records.append({"api": api, "pid": int(ev.pid), "tid": int(ev.tid),
                             "ts_ns": self.clock.to_epoch_ns(ev.ts), "dur_ns": int(ev.dur_ns), "family": family})

    def close(self) -> None:
        for pid in list(self.pids):
            self.remove_pid(pid)
        self._gate = None
        bpf, self.bpf = getattr(self, "bpf", None), None
        if bpf is not None:
            bpf.cleanup()

    def _family_detached(self, family: str) -> None:
        # calls entered now will return unseen
        self.bpf[PROGRAMS[family][2]].clear()

    def _attach(self, pid: int, family: str) -> None:
        if family not in self.pids[pid]:
            return  # this process has no probes of the family (see family_unavailable)
        p = self.pids[pid][family]
        entry, ret, _ = PROGRAMS[family]
        if p.exits:  # plain uprobes on the `ret` instructions: nothing on the stack is replaced
            exit_link = Link(self._prog[ret], p.lib, p.exits, p.exit_cookies)
        else:  # a uretprobe, refused by the link set unless RETURN_PROBES covers every symbol
            exit_link = Link(self._prog[ret], p.lib, p.entries, p.cookies, retprobe=True, symbols=p.symbols)
        self.links.attach((pid, family), [Link(self._prog[entry], p.lib, p.entries, p.cookies), exit_link], pid)

    def remove_pid(self, pid: int) -> None:
        super().remove_pid(pid)
        self.family_unavailable.pop(int(pid), None)

    def _forget(self, pid: int) -> None:
        self.remove_pid(pid)
        self.marks.forget(pid)
        for name in (b"ops", b"comm_waits", b"comm_max", b"coll_marks"):
            table = self.bpf[name]
            for k in [k for k in table.keys() if k.pid == pid]:
                table.pop(k, None)
        lost = self.bpf[b"lost"]
        lost.pop(lost.Key(pid), None)
        for prev in self._prev.values():
            for k in [k for k in prev if (k[0] if isinstance(k, tuple) else k) == pid]:
                del prev[k]
