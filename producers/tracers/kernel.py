"""KernelTracer: off-CPU time, context switches, TCP retransmits, IRQs and how
traced processes ended, from tracepoints.

The BPF side (bpf/kernel.bpf.c) keeps cumulative counters in maps; each
`sample()` reads them and emits the increase since the previous sample as
delta rows (interval_ns = time since that sample). Diffing cumulative
counters, rather than read-then-zero, loses nothing to increments that land
between the read and the reset.

How a traced process ended is one `kernel.process_exit` row (value 1) in the
sample that stops tracing it, with its last deltas: device `signal:<NAME>`
(`signal:SIGKILL`, `signal:SIGSEGV`, ...; `signal:<N>` for a number Python
does not name) when a signal ended it, else `exit:<status>`. That tells a
crashed rank (SIGKILL from the OOM killer, SIGSEGV, SIGABRT, a non-zero exit)
from one its launcher stopped (SIGTERM) or one that finished (`exit:0`). The
resolver no longer knows a process that is gone, so a pid's rows carry the
identity last resolved for it (at add_pid, refreshed whenever its rows are built).
Kernels whose sched_process_exit lacks group_dead (which thread is a process's
last) trace everything else, without exit rows.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import signal
import struct
import time
from collections.abc import Iterable
from pathlib import Path

from fleetscope.wire import Batch
from fleetscope.producers.tracers.rows import LastKnownIdentities, RowIdentity, diff, identity, metric_batch
from fleetscope.resources import package_dir

log = logging.getLogger(__name__)

BPF_DIR = package_dir("fleetscope.bpf")
TRACEPOINTS = ("sched/sched_switch", "tcp/tcp_retransmit_skb", "irq/irq_handler_entry")
EXIT_TRACEPOINT = "sched/sched_process_exit"  # optional: kernels whose event lacks group_dead go without
TRACEFS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")
VMLINUX_BTF = Path("/sys/kernel/btf/vmlinux")


def exit_device(code: int) -> str:
    """The device of a kernel.process_exit row, from a wait-status exit code."""
    sig = code & 0x7F  # 0x80 is the core-dump bit, bits 8..15 the exit status
    if not sig:
        return f"exit:{(code >> 8) & 0xFF}"
    try:
        return f"signal:{signal.Signals(sig).name}"
    except ValueError:  # real-time signals other than SIGRTMIN/SIGRTMAX have no name
        return f"signal:{sig}"


def btf_member_offset(struct_name: str, member: str, path: Path = VMLINUX_BTF) -> int | None:
    """Byte offset of a direct member of a kernel struct, from the running kernel's BTF; None when there is
    no BTF or no such member. bcc lays structs out from the installed headers, which can be another
    kernel's; BTF is this kernel's."""
    try:
        data = path.read_bytes()
        magic, _, _, hdr_len, type_off, type_len, str_off, _ = struct.unpack_from("<HBBIIIII", data)
        if magic != 0xEB9F:
            return None
        strings, pos = hdr_len + str_off, hdr_len + type_off
        want = struct_name.encode() + b"\0"
        while pos < hdr_len + type_off + type_len:
            name_off, info, _ = struct.unpack_from("<III", data, pos)
            kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
            pos += 12
            if kind == 4 and data.startswith(want, strings + name_off):  # BTF_KIND_STRUCT
                for i in range(vlen):
                    m_name, _, m_off = struct.unpack_from("<III", data, pos + 12 * i)
                    if data.startswith(member.encode() + b"\0", strings + m_name):
                        return (m_off & 0xFFFFFF if info >> 31 else m_off) // 8  # bits; kind_flag: bitfields
                return None
            pos += _BTF_EXTRA.get(kind, 0) + _BTF_PER_ITEM.get(kind, 0) * vlen
    except (OSError, struct.error):
        return None
    return None


# Bytes after a btf_type header: fixed (INT, ARRAY, VAR, DECL_TAG) and per vlen item (STRUCT, UNION, ENUM,
# FUNC_PROTO, DATASEC, ENUM64); the other kinds have none.
_BTF_EXTRA = {1: 4, 3: 12, 14: 4, 17: 4}
_BTF_PER_ITEM = {4: 12, 5: 12, 6: 8, 13: 8, 15: 12, 19: 12}


class TracerUnavailable(RuntimeError):
    """This host cannot run the tracer; the message says why and what to do."""


def _check_host() -> Path:
    """tracefs's events folder, once the host is known to run the tracer."""
    if os.geteuid() != 0:
        raise TracerUnavailable("the kernel tracer loads BPF programs and needs root (or CAP_BPF+CAP_PERFMON): "
                                "run the agent as root or in a privileged container")
    events = next((Path(t) / "events" for t in TRACEFS if (Path(t) / "events").is_dir()), None)
    if events is None:
        raise TracerUnavailable("tracefs is not mounted: mount -t tracefs nodev /sys/kernel/tracing "
                                "(install.sh does this)")
    missing = [tp for tp in TRACEPOINTS if not (events / tp).is_dir()]
    if missing:
        raise TracerUnavailable(f"this kernel lacks the tracepoint(s) {', '.join(missing)} "
                                f"(looked under {events}); the kernel tracer cannot run here")
    return events


def _exit_probe_flags(events: Path) -> list[str]:
    """The compiler flags of the process-exit probe: on, and where task_struct keeps exit_code in this
    kernel. None where the tracepoint does not say which thread is a process's last (group_dead)."""
    try:
        group_dead = "group_dead" in (events / EXIT_TRACEPOINT / "format").read_text()
    except OSError:
        group_dead = False
    if not group_dead:
        log.warning("%s has no group_dead field on kernel %s: no kernel.process_exit rows", EXIT_TRACEPOINT,
                    os.uname().release)
        return []
    at = btf_member_offset("task_struct", "exit_code")
    if at is None:
        log.warning("no task_struct.exit_code in the kernel's BTF (%s): process exits are read at the offset "
                    "of the installed kernel headers, which must match this kernel", VMLINUX_BTF)
        return ["-DPROCESS_EXIT_PROBE"]
    return ["-DPROCESS_EXIT_PROBE", f"-DTASK_EXIT_CODE_OFFSET={at}"]


class KernelTracer:
    RETURN_PROBES: dict[str, str] = {}  # none: tracepoints only, no uprobes

    def __init__(self, host: str, resolver=None, pids: Iterable[int] = ()):
        events = _check_host()
        try:
            from bcc import BPF  # Debian's python3-bpfcc; the PyPI "bcc" is unrelated
        except ImportError as e:
            raise TracerUnavailable(f"bcc is not importable ({e}): install Debian's python3-bpfcc "
                                    "and run install.sh, which links it into the venv") from e
        self.host = host
        self.resolver = resolver
        try:
            self.bpf = BPF(text=(BPF_DIR / "kernel.bpf.c").read_bytes(),
                           cflags=[f"-I{BPF_DIR}", "-Wno-everything", *_exit_probe_flags(events)])
        except Exception as e:  # compile or attach failure: bcc raises bare Exception
            raise TracerUnavailable(f"loading bpf/kernel.bpf.c failed ({e}); check that kernel headers exist "
                                    f"at /lib/modules/{os.uname().release}/build (install.sh links them)") from e
        self._targets = self.bpf[b"targets"]
        self._offcpu, self._switches = self.bpf[b"offcpu_ns"], self.bpf[b"switches"]
        self._runq = self.bpf[b"runq_ns"]
        self._retrans, self._irqs = self.bpf[b"retransmits"], self.bpf[b"irqs"]
        self._exits = self.bpf[b"exits"]
        from bcc.utils import get_possible_cpus
        self._cpus = get_possible_cpus()  # per-CPU values come in this order
        self._last_ns = time.time_ns()
        # Previous cumulative values, per map, to diff against.
        self._prev: dict[str, dict] = {"offcpu": {}, "runq": {}, "switches": {}, "tcp": {}, "irq": {}}
        self._prev["irq"] = self._read_irqs()
        self.pids: set[int] = set()
        self._identities = LastKnownIdentities(self.resolver, host)  # per traced pid
        self._exit_codes: dict[int, int] = {}  # ended, still traced: their last deltas may be on the way
        # Untraced since the last sample: (exit code or None, last identity); that sample reports them.
        self._departed: dict[int, tuple[int | None, RowIdentity | None]] = {}
        for pid in pids:
            self.add_pid(pid)

    def add_pid(self, pid: int) -> None:
        pid = int(pid)
        self._targets[self._targets.Key(pid)] = self._targets.Leaf(1)
        self.pids.add(pid)
        self._identities.resolve(pid)

    def remove_pid(self, pid: int) -> None:
        """Stop tracing `pid`. An exit it made is still reported, by the next sample."""
        pid = int(pid)
        code = self._exit_codes.pop(pid, None)
        if code is None:
            code = self._pop_exit(pid)
        if pid in self.pids:
            self._departed[pid] = (code, self._identities.forget(pid))
        self.pids.discard(pid)
        for table in (self._targets, self._offcpu, self._runq, self._switches):
            try:
                del table[table.Key(pid)]
            except KeyError:
                pass
        self._prev["offcpu"].pop(pid, None)
        self._prev["runq"].pop(pid, None)
        self._prev["switches"].pop(pid, None)

    def sample(self, now_ns: int | None = None) -> Batch | None:
        """Delta rows since the previous sample, or None if nothing changed."""
        now_ns = time.time_ns() if now_ns is None else int(now_ns)
        interval = max(now_ns - self._last_ns, 0)
        self._last_ns = now_ns
        rows: list[tuple] = []  # (metric, device, value, pid, identity-or-None)
        for metric, name, table in (("kernel.offcpu_ns", "offcpu", self._offcpu),
                                    ("kernel.runq_wait_ns", "runq", self._runq),
                                    ("kernel.ctx_switches", "switches", self._switches)):
            current = {k.value: v.value for k, v in table.items()}
            for pid, delta in self._diff(name, current).items():
                if pid in self.pids:
                    rows.append((metric, f"pid{pid}", delta, pid))
        tcp = {self._conn_label(k): v.value for k, v in self._retrans.items()}
        rows += [("kernel.tcp_retransmits", dev, d, 0) for dev, d in self._diff("tcp", tcp).items()]
        rows += [("kernel.irq_count", f"cpu{cpu}", d, 0)
                 for cpu, d in self._diff("irq", self._read_irqs()).items()]
        self._read_exits()
        # A traced process that has ended has reported its last delta above.
        for pid in [p for p in self.pids if self._ended(p)]:
            self.remove_pid(pid)
        departed, self._departed = self._departed, {}
        rows += [("kernel.process_exit", exit_device(code), 1.0, pid)
                 for pid, (code, _) in departed.items() if code is not None]

        def identity_of(pid: int) -> RowIdentity:
            remembered = departed.get(pid, (None, None))[1]
            return remembered if remembered is not None else self._identity(pid)

        return metric_batch("kernel", self.host, rows, now_ns, interval, identity_of) if rows else None

    def close(self) -> None:
        bpf, self.bpf = getattr(self, "bpf", None), None
        if bpf is not None:
            bpf.cleanup()  # detaches the tracepoints and frees the maps

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _diff(self, name: str, current: dict) -> dict:
        """Positive increases since the last read; keys gone from the map are forgotten."""
        out = diff(self._prev[name], current)
        self._prev[name] = current
        return out

    def _read_exits(self) -> None:
        """Move the exits the probe recorded into `_exit_codes` (traced pids) and clear the map."""
        for k, v in self._exits.items():
            if k.value in self.pids:
                self._exit_codes[k.value] = v.value
            del self._exits[k]

    def _pop_exit(self, pid: int) -> int | None:
        key = self._exits.Key(pid)
        try:
            code = self._exits[key].value
            del self._exits[key]
        except KeyError:
            return None
        return code

    def _ended(self, pid: int) -> bool:
        """Gone from /proc, or exited and left unreaped: a zombie has made its final switch-out, so its
        deltas are all in (the launcher reaping it late must not hold back its exit row)."""
        if pid not in self._exit_codes:
            return not os.path.exists(f"/proc/{pid}")
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        return state in (b"Z", b"X")

    def _read_irqs(self) -> dict:
        per_cpu = self._irqs.getvalue(self._irqs.Key(0))
        return {cpu: int(per_cpu[i]) for i, cpu in enumerate(self._cpus)}

    @staticmethod
    def _conn_label(k) -> str:
        if k.family == 2:
            src, dst = ipaddress.IPv4Address(bytes(k.saddr[:4])), ipaddress.IPv4Address(bytes(k.daddr[:4]))
            return f"{src}:{k.sport}->{dst}:{k.dport}"
        src, dst = ipaddress.IPv6Address(bytes(k.saddr)), ipaddress.IPv6Address(bytes(k.daddr))
        return f"[{src}]:{k.sport}->[{dst}]:{k.dport}"

    def _identity(self, pid: int) -> RowIdentity:
        """The resolver's identity of `pid`; for a traced pid it has no answer for (gone, or a zombie),
        the one last resolved."""
        return self._identities.resolve(pid) if pid in self.pids else identity(self.resolver, self.host, pid)
