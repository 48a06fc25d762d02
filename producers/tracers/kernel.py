"""KernelTracer: off-CPU time, context switches, TCP retransmits and IRQs from tracepoints.

The BPF side (bpf/kernel.bpf.c) keeps cumulative counters in maps; each
`sample()` reads them and emits the increase since the previous sample as
delta rows (interval_ns = time since that sample). Diffing cumulative
counters, rather than read-then-zero, loses nothing to increments that land
between the read and the reset.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

from fleetscope.wire import Batch
from fleetscope.producers.tracers.rows import RowIdentity, diff, identity, metric_batch
from fleetscope.resources import package_dir

log = logging.getLogger(__name__)

BPF_DIR = package_dir("fleetscope.bpf")
TRACEPOINTS = ("sched/sched_switch", "tcp/tcp_retransmit_skb", "irq/irq_handler_entry")
TRACEFS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")


class TracerUnavailable(RuntimeError):
    """This host cannot run the tracer; the message says why and what to do."""


def _check_host() -> None:
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


class KernelTracer:
    RETURN_PROBES: dict[str, str] = {}  # none: tracepoints only, no uprobes

    def __init__(self, host: str, resolver=None, pids: Iterable[int] = ()):
        _check_host()
        try:
            from bcc import BPF  # Debian's python3-bpfcc; the PyPI "bcc" is unrelated
        except ImportError as e:
            raise TracerUnavailable(f"bcc is not importable ({e}): install Debian's python3-bpfcc "
                                    "and run install.sh, which links it into the venv") from e
        self.host = host
        self.resolver = resolver
        try:
            self.bpf = BPF(text=(BPF_DIR / "kernel.bpf.c").read_bytes(),
                           cflags=[f"-I{BPF_DIR}", "-Wno-everything"])
        except Exception as e:  # compile or attach failure: bcc raises bare Exception
            raise TracerUnavailable(f"loading bpf/kernel.bpf.c failed ({e}); check that kernel headers exist "
                                    f"at /lib/modules/{os.uname().release}/build (install.sh links them)") from e
        self._targets = self.bpf[b"targets"]
        self._offcpu, self._switches = self.bpf[b"offcpu_ns"], self.bpf[b"switches"]
        self._runq = self.bpf[b"runq_ns"]
        self._retrans, self._irqs = self.bpf[b"retransmits"], self.bpf[b"irqs"]
        from bcc.utils import get_possible_cpus
        self._cpus = get_possible_cpus()  # per-CPU values come in this order
        self._last_ns = time.time_ns()
        # Previous cumulative values, per map, to diff against.
        self._prev: dict[str, dict] = {"offcpu": {}, "runq": {}, "switches": {}, "tcp": {}, "irq": {}}
        self._prev["irq"] = self._read_irqs()
        self.pids: set[int] = set()
        for pid in pids:
            self.add_pid(pid)

    def add_pid(self, pid: int) -> None:
        pid = int(pid)
        self._targets[self._targets.Key(pid)] = self._targets.Leaf(1)
        self.pids.add(pid)

    def remove_pid(self, pid: int) -> None:
        pid = int(pid)
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
        # A traced process that exited has reported its last delta above.
        for pid in [p for p in self.pids if not os.path.exists(f"/proc/{p}")]:
            self.remove_pid(pid)
        return metric_batch("kernel", self.host, rows, now_ns, interval, self._identity) if rows else None

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

    def _identity(self, pid: int) :
        return identity(self.resolver, self.host, pid)
