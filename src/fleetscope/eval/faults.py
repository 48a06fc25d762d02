"""Fault injectors: each one starts, stops, and leaves nothing behind, even after an error.

Every injector is a `Fault` with start() and stop(); stop() is idempotent and undoes
whatever part of start() happened. Use `with fault:` or try/finally. `make_fault()` builds
one from a scenario's `fault` block. `strength` is in (0, 1]; 1 means the full amount named
in the params.

| kind             | what it does to the rank                                            | strength means              |
|------------------|----------------------------------------------------------------------|-----------------------------|
| cpu_quota        | child cgroup with a CFS quota (cpu.max / cpu.cfs_quota_us)           | share of `cpus` (or, with   |
|                  |                                                                      | `basis: usage`, of the CPU  |
|                  |                                                                      | the rank used) taken away   |
| competing_load   | busy-loop hogs pinned to the rank's CPU; the rank pinned there too   | hog duty cycle              |
| memory_pressure  | rank + a page-touching hog in one memory cgroup whose limit is short | share of the hog not fitting|
| softirq_storm    | loopback UDP flood, sender and receiver pinned to the rank's CPU     | sender duty cycle           |
| gc_storm, dataloader_stall, memcpy_stall, gpu_memory_leak | opt-in knob in the rank's control file, read by our workload | share of the knob's full amount |
| link_delay       | a DelayRelay the rank connects through gets latency/bandwidth caps   | share of delay_ms, cap      |
| hang             | knob: the rank stops calling collectives while it is set (ddp_cpu)   | -                           |
| gpu_throttle     | knob: the stand-in's kernels take longer, as at lower clocks         | share of kernel_slowdown    |
| crash            | SIGKILL of the rank process (torchrun then ends the job)             | -                           |
| irq_affinity     | device IRQs moved onto the rank's CPU (/proc/irq/N/smp_affinity),    | duty of the disk I/O helper |
|                  | rank pinned there, a disk writer elsewhere makes those IRQs fire     |                             |
| thp_off          | transparent huge pages set to never for the node, restored after     | -                           |
| none             | nothing (healthy runs)                                               | -                           |

Honest notes:
- softirq_storm: loopback has no hardware interrupt; the flood makes NET_RX softirq work on
  the pinned CPU (cpu_softirq_frac, context switches), not hardirqs. A real IRQ storm
  (a NIC's interrupts landing on the rank's core) needs hardware.
- gc_storm, dataloader_stall and the GPU stand-in faults happen inside the training program.
  Causing them from outside would mean changing the program, so our workloads read an
  opt-in control file (FLEETSCOPE_WORKLOAD_CONTROL_DIR); the injector only writes that file.
- link_delay reaches only connections made to the relay's address. gloo's peer connections
  go straight to the addresses each rank publishes in the store; without netem (not built)
  or netfilter userspace (not installed) they cannot be routed through a relay, so this
  kind cannot degrade gloo's all-reduce. See benchmarks/scenarios/network_degradation.yaml.
  It is therefore never scored on ddp_cpu (UNSCORED); on the GPU stand-in, whose ring goes
  through relays, it is real and scored.
- Not made here at all: NUMA misplacement (a one-node VM has one NUMA node).
- The NVML side of GPU faults is a stand-in: a scenario that requires `nvml_standin` runs the
  agent against the scripted NVML (eval/nvml_standin.py), whose control file changes mid-run.
  There gpu_throttle also reports a throttle reason, a lower SM clock and a hot die for the
  rank's GPU (GpuThrottle). Without it, gpu_throttle makes only the workload side real
  (slower kernels), and the detector sees no throttle reason.
- irq_affinity on this VM moves virtio IRQs (disk, network); there is no real NIC. Some IRQs
  refuse a new mask (managed IRQs: EIO); those are skipped, and if none moves the fault fails
  rather than running as a no-op.
- thp_off: a small job may not notice; the run's measured impact says so ("no effect").
- memory_pressure on cgroup v1 (this machine): v1 has no memory.high, so the limit is
  memory.limit_in_bytes with the OOM killer disabled for the group (tasks wait rather than
  die); on v2 it is memory.high (throttling and reclaim, never a kill).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fleetscope.eval.cgroups import FaultCgroup
from fleetscope.eval.relay import DelayRelay

KNOB_KINDS = {  # kind -> (knob name in the control file, its parameter, full amount)
    "gc_storm": ("gc_storm", "cycles_per_step", 50000),
    "dataloader_stall": ("dataloader_stall", "ms_per_batch", 200),
    "memcpy_stall": ("memcpy_stall", "extra_ms", 50),
    "gpu_memory_leak": ("gpu_memory_leak", "bytes_per_step", 64 << 20),
    "hang": ("hang", "poll_ms", 50),
    "gpu_throttle": ("gpu_throttle", "kernel_slowdown", 1.0),
}

# (kind, workload) pairs this machine cannot make real: reported, never scored.
UNSCORED = {("link_delay", "ddp_cpu"): "gloo's peer connections bypass the relay and there is no netem here"}
NODE_WIDE_KINDS = {"thp_off"}  # one injector for the node, whatever the target


def unscored_reason(kind: str, workload: str) -> str | None:
    return UNSCORED.get((kind, workload))

HOG = r"""
import sys, time
duty, period = float(sys.argv[1]), 0.01
while True:
    end = time.perf_counter() + duty * period
    while time.perf_counter() < end:
        pass
    if duty < 1:
        time.sleep(period * (1 - duty))
"""

MEMORY_HOG = r"""
import sys, time
buf = bytearray(int(sys.argv[1]) << 20)  # zero pages: charged only as they are touched
while True:  # keep every page hot, so the pages that do not fit must be reclaimed again and again
    for i in range(0, len(buf), 4096):
        buf[i] = (buf[i] + 1) & 0xFF
    time.sleep(0.05)
"""

UDP_FLOOD = r"""
import socket, sys, time
role, port, duty = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
if role == "rx":
    s.bind(("127.0.0.1", port))
    print("ready", flush=True)
    while True:
        s.recv(2048)
payload, period = b"x" * 64, 0.01
while True:
    end = time.perf_counter() + duty * period
    while time.perf_counter() < end:
        s.sendto(payload, ("127.0.0.1", port))
    if duty < 1:
        time.sleep(period * (1 - duty))
"""


class FaultError(RuntimeError):
    """A fault could not be injected; the message says which and why."""


def _check_strength(kind: str, strength: float) -> float:
    if not 0 < strength <= 1:
        raise FaultError(f"{kind}: strength must be in (0, 1], got {strength}")
    return float(strength)


def last_cpu(pid: int) -> int:
    """The CPU the process last ran on (field 39 of /proc/<pid>/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[36])


def cpu_seconds_precise(pid: int) -> float:
    """The time the process's live threads have run so far, in ns precision (/proc/<pid>/task/*/schedstat):
    over a second, stat's 10 ms ticks are a 7% error on a process that uses 15% of a core."""
    total = 0
    for tid in threads_of(pid):
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass   # the thread exited meanwhile
    return total / 1e9


def cpu_share(pid: int, seconds: float) -> float:
    """The share of one CPU the process uses over the next `seconds` (blocks that long)."""
    c0, t0 = cpu_seconds_precise(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds_precise(pid) - c0) / (time.monotonic() - t0)


def threads_of(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


class Fault:
    kind = "none"

    def __init__(self) -> None:
        self.active = False

    def prime(self) -> None:
        """Called (by the runner, PRIME_LEAD_S before start) to begin whatever must be measured before the
        fault starts; a fault that measures nothing ignores it."""

    def start(self) -> None:
        self.active = True

    def stop(self) -> None:
        self.active = False

    def describe(self) -> dict:
        return {"kind": self.kind}

    def __enter__(self) -> "Fault":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class _Processes:
    """Helper processes we started (hogs, floods); stop() kills exactly these pids."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def spawn(self, code: str, *args: str, cpu: int | None = None, wait_ready: bool = False) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
        self.procs.append(p)
        if cpu is not None:
            os.sched_setaffinity(p.pid, {cpu})
        if wait_ready and p.stdout.readline().strip() != "ready":
            raise FaultError(f"helper process {p.pid} exited with {p.poll()} before it was ready")
        return p

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()
            if p.stdout:
                p.stdout.close()
        self.procs.clear()


class _Pinning:
    """Pin every thread of a process to one CPU; restore each thread's old mask on undo."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.saved: dict[int, set[int]] = {}

    def pin(self, cpu: int) -> None:
        for tid in threads_of(self.pid):
            try:
                self.saved[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, {cpu})
            except ProcessLookupError:
                pass

    def undo(self) -> None:
        for tid, mask in self.saved.items():
            try:
                os.sched_setaffinity(tid, mask)
            except ProcessLookupError:
                pass
        self.saved.clear()


class CpuQuota(Fault):
    """Cap the rank's CPU time with a CFS quota in a child cgroup.

    basis "cpus": the quota is `cpus` x (1 - strength) of a CPU, a fixed cap. Whether it bites
    depends on how much CPU the rank happens to use on this machine: a rank that uses 16% of a core
    barely notices a 15% cap (measured: -5% step rate), though the same cap took 63% off a rank that
    used 42%. basis "usage": the rank's own CPU use is measured over at least `measure_s` just before
    the fault (from prime(), or from start(), which then waits), and the cap is that x (1 - strength),
    so the strength means the same on any machine. The runner primes every rank's injector at once, so
    a fault on every rank measures them over the same stretch: measured one after another over 0.5 s
    of stat's clock ticks, three alike ranks read 0.16, 0.14 and 0.10, and the lowest cap made its rank
    a straggler in what was meant as a job-wide slowdown.
    """
    kind = "cpu_quota"
    MIN_QUOTA_US = 1000  # the kernel's smallest CFS quota

    def __init__(self, pid: int, strength: float, cpus: float = 1.0, period_us: int = 100_000,
                 basis: str = "cpus", measure_s: float = 1.0):
        super().__init__()
        if basis not in ("cpus", "usage"):
            raise FaultError(f"cpu_quota: basis must be 'cpus' or 'usage', got {basis!r}")
        self.pid, self.strength = pid, _check_strength(self.kind, strength)
        self.cpus, self.period_us, self.basis, self.measure_s = cpus, period_us, basis, measure_s
        self.used_cpus: float | None = None
        self._primed: tuple[float, float] | None = None   # (process CPU s, monotonic s) at prime()
        self.quota_us = self._quota_us(cpus)
        self.cgroup: FaultCgroup | None = None

    def _quota_us(self, cpus: float) -> int:
        return max(self.MIN_QUOTA_US, int(self.period_us * cpus * (1 - self.strength)))

    def prime(self) -> None:
        if self.basis == "usage":
            self._primed = (cpu_seconds_precise(self.pid), time.monotonic())

    def start(self) -> None:
        if self.basis == "usage":
            if self._primed is None:
                self.prime()
            cpu0, t0 = self._primed
            time.sleep(max(0.0, t0 + self.measure_s - time.monotonic()))
            self.used_cpus = (cpu_seconds_precise(self.pid) - cpu0) / (time.monotonic() - t0)
            self.quota_us = self._quota_us(self.used_cpus)
        self.cgroup = FaultCgroup("cpu", f"cpu-quota-{self.pid}", self.pid)
        if self.cgroup.version == 2:
            self.cgroup.write("cpu.max", f"{self.quota_us} {self.period_us}")
        else:
            self.cgroup.write("cpu.cfs_period_us", str(self.period_us))
            self.cgroup.write("cpu.cfs_quota_us", str(self.quota_us))
        self.cgroup.add(self.pid)
        super().start()

    def stop(self) -> None:
        if self.cgroup is not None:
            self.cgroup.close()
            self.cgroup = None
        super().stop()

    def describe(self) -> dict:
        d = {"kind": self.kind, "pid": self.pid, "quota_us": self.quota_us, "period_us": self.period_us,
             "basis": self.basis}
        if self.used_cpus is not None:
            d["used_cpus_before"] = round(self.used_cpus, 4)
        return d


class CompetingLoad(Fault):
    """Busy-loop hogs on the rank's CPU, with the rank pinned there so it cannot run away.
    With pid None (a noisy process outside the job) the hogs go on `cpu`, or anywhere when None."""
    kind = "competing_load"

    def __init__(self, pid: int | None, strength: float, hogs: int = 1, cpu: int | None = None,
                 pin_rank: bool = True):
        super().__init__()
        self.pid, self.duty = pid, _check_strength(self.kind, strength)
        self.hogs, self.cpu, self.pin_rank = hogs, cpu, pin_rank
        self._procs, self._pinning = _Processes(), _Pinning(pid or 0)

    def start(self) -> None:
        if self.pid is not None:
            self.cpu = last_cpu(self.pid) if self.cpu is None else self.cpu
            if self.pin_rank:
                self._pinning.pin(self.cpu)
        for _ in range(self.hogs):
            self._procs.spawn(HOG, str(self.duty), cpu=self.cpu)
        super().start()

    def stop(self) -> None:
        self._procs.stop()
        self._pinning.undo()
        super().stop()

    def describe(self) -> dict:
        return {"kind": self.kind, "pid": self.pid, "cpu": self.cpu, "hogs": self.hogs, "duty": self.duty}


class SoftirqStorm(CompetingLoad):
    """A loopback UDP flood pinned to the rank's CPU: NET_RX softirq work lands there."""
    kind = "softirq_storm"

    def __init__(self, pid: int, strength: float, cpu: int | None = None, port: int = 0, pin_rank: bool = True):
        super().__init__(pid, strength, hogs=0, cpu=cpu, pin_rank=pin_rank)
        self.port = port

    def start(self) -> None:
        super().start()
        if not self.port:
            from fleetscope.eval.workloads.launch import free_port
            self.port = free_port()
        self._procs.spawn(UDP_FLOOD, "rx", str(self.port), "1", cpu=self.cpu, wait_ready=True)
        self._procs.spawn(UDP_FLOOD, "tx", str(self.port), str(self.duty), cpu=self.cpu)


class MemoryPressure(Fault):
    """The rank and a page-touching hog share a memory cgroup whose limit the hog overfills."""
    kind = "memory_pressure"

    def __init__(self, pid: int, strength: float, hog_mb: int = 512):
        super().__init__()
        self.pid, self.strength, self.hog_mb = pid, _check_strength(self.kind, strength), hog_mb
        self.cgroup: FaultCgroup | None = None
        self._procs = _Processes()
        self.limit_bytes = 0

    def start(self) -> None:
        self.cgroup = cg = FaultCgroup("memory", f"memory-{self.pid}", self.pid)
        if cg.version == 1:
            try:  # charge the rank's pages to the new group (v1 only; deprecated, may be absent)
                cg.write("memory.move_charge_at_immigrate", "3")
            except OSError:
                pass
            cg.write("memory.oom_control", "1")  # wait, never kill the rank
        cg.add(self.pid)
        usage = int(cg.read("memory.current" if cg.version == 2 else "memory.usage_in_bytes"))
        self.limit_bytes = usage + int((self.hog_mb << 20) * (1 - self.strength))
        cg.write("memory.high" if cg.version == 2 else "memory.limit_in_bytes", str(self.limit_bytes))
        # The hog starts inside the group (it moves itself before exec) and faults its pages in
        # over about a second; past the limit, the group's file pages (the rank's code and
        # cache) are reclaimed and faulted back in, and allocations stall.
        self._procs.procs.append(subprocess.Popen(
            [sys.executable, "-c", MEMORY_HOG, str(self.hog_mb)], stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True,
            preexec_fn=lambda: (cg.path / "cgroup.procs").write_text(str(os.getpid()))))
        super().start()

    def stop(self) -> None:
        self._procs.stop()
        if self.cgroup is not None:
            self.cgroup.close()
            self.cgroup = None
        super().stop()

    def describe(self) -> dict:
        return {"kind": self.kind, "pid": self.pid, "hog_mb": self.hog_mb, "limit_bytes": self.limit_bytes}


class WorkloadKnob(Fault):
    """Turn on an opt-in fault knob in the rank's control file; remove it on stop."""

    def __init__(self, kind: str, control_dir: Path, rank: int, strength: float, params: dict | None = None):
        super().__init__()
        if kind not in KNOB_KINDS:
            raise FaultError(f"unknown workload knob {kind!r}; known: {sorted(KNOB_KINDS)}")
        self.kind = kind
        knob, param, full = KNOB_KINDS[kind]
        self.knob = knob
        self.settings = {param: (params or {}).get(param, full) * _check_strength(kind, strength)}
        self.path = Path(control_dir) / f"rank{rank}.json"

    def _write(self, knobs: dict) -> None:
        if not knobs:
            self.path.unlink(missing_ok=True)
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(knobs))
        os.replace(tmp, self.path)  # the workload never reads a half-written file

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}

    def start(self) -> None:
        if not self.path.parent.is_dir():
            raise FaultError(f"{self.kind}: control dir {self.path.parent} does not exist; start the workload "
                             "with FLEETSCOPE_WORKLOAD_CONTROL_DIR pointing there")
        self._write({**self._read(), self.knob: self.settings})
        super().start()

    def stop(self) -> None:
        knobs = self._read()
        knobs.pop(self.knob, None)
        self._write(knobs)
        super().stop()

    def describe(self) -> dict:
        return {"kind": self.kind, "file": str(self.path), self.knob: self.settings}


class GpuThrottle(Fault):
    """gpu_throttle with the NVML stand-in loaded: the rank's kernels slow down (the workload's knob) and NVML
    says why, as on a clock-capped GPU: a power-cap and thermal throttle reason, the SM clock lowered by the
    same factor as the kernels, a hot die."""
    kind = "gpu_throttle"

    def __init__(self, knob: WorkloadKnob, nvml, rank: int):
        super().__init__()
        from fleetscope.eval.nvml_standin import throttled_values
        self.knob, self.nvml, self.rank = knob, nvml, rank
        self.owner = f"gpu_throttle:rank{rank}"
        self.values = throttled_values(knob.settings["kernel_slowdown"])

    def start(self) -> None:
        self.knob.start()
        try:
            self.nvml.override(self.owner, self.rank, **self.values)
        except BaseException:
            self.knob.stop()
            raise
        super().start()

    def stop(self) -> None:
        try:
            self.nvml.clear(self.owner)
        finally:
            self.knob.stop()
            super().stop()

    def describe(self) -> dict:
        return {**self.knob.describe(), "nvml": {"gpu": self.rank, **self.values}}


class LinkDelay(Fault):
    """Add latency and a bandwidth cap to a relay the rank's traffic already goes through."""
    kind = "link_delay"

    def __init__(self, relay: DelayRelay, strength: float, delay_ms: float = 20.0, bandwidth_mbps: float = 0.0):
        super().__init__()
        self.relay, s = relay, _check_strength(self.kind, strength)
        self.delay_s = delay_ms / 1000.0 * s
        # strength 1 caps at bandwidth_mbps; weaker faults leave more (cap / strength); 0 = no cap
        self.bandwidth_bps = bandwidth_mbps * 1e6 / s if bandwidth_mbps else 0.0
        self._saved: tuple[float, float] | None = None

    def start(self) -> None:
        self._saved = (self.relay.delay_s, self.relay.bandwidth_bps)
        self.relay.set(self.delay_s, self.bandwidth_bps)
        super().start()

    def stop(self) -> None:
        if self._saved is not None:
            self.relay.set(*self._saved)
            self._saved = None
        super().stop()


class Crash(Fault):
    """SIGKILL the rank process, as an OOM kill or a segfault would end it. Nothing to undo:
    under torchrun (--max-restarts=0) the other ranks are then stopped too, as in a real job."""
    kind = "crash"

    def __init__(self, pid: int, strength: float = 1.0):
        super().__init__()
        self.pid = pid
        self.killed = False

    def start(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            raise FaultError(f"crash: rank process {self.pid} is already gone") from None
        self.killed = True
        super().start()

    def describe(self) -> dict:
        return {"kind": self.kind, "pid": self.pid, "killed": self.killed}


class GpuXid(Fault):
    """The driver reports an Xid on the rank's GPU (through the NVML stand-in), then the rank dies, as a process
    whose GPU fell off the bus (Xid 79) or lost a page to a double-bit ECC error (Xid 48) does: its next CUDA call
    fails and it ends. The Xid comes first and the process ends `after_s` later (SIGKILL: this stand-in job has no
    CUDA call that could fail). An Xid that leaves the process running (a recoverable one) slows nothing, so it
    would be "no effect" and is not modelled. Needs the stand-in (`requires: [nvml_standin]`)."""
    kind = "gpu_xid"

    def __init__(self, crash: Crash, nvml, rank: int, code: int = 79, after_s: float = 0.3):
        super().__init__()
        if nvml is None:
            raise FaultError("gpu_xid needs the NVML stand-in: add nvml_standin to the scenario's requires")
        if not isinstance(code, int) or code <= 0:
            raise FaultError(f"gpu_xid: code must be a positive Xid number, got {code!r}")
        self.crash, self.nvml, self.rank, self.code, self.after_s = crash, nvml, rank, code, float(after_s)
        self.owner = f"gpu_xid:rank{rank}"

    def start(self) -> None:
        self.nvml.override(self.owner, self.rank, xid=self.code)
        time.sleep(self.after_s)  # the driver logs the Xid before the process sees its CUDA call fail
        self.crash.start()
        super().start()

    def stop(self) -> None:
        self.nvml.clear(self.owner)
        super().stop()

    def describe(self) -> dict:
        return {"kind": self.kind, "xid": self.code, "gpu": self.rank, "then": self.crash.describe()}


DISK_WRITER = r"""
import os, sys, time
path, duty, period = sys.argv[1], float(sys.argv[2]), 0.01
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
block = os.urandom(64 << 10)
try:
    while True:  # every fsync is a disk request; its completion is a virtio-blk interrupt
        end = time.perf_counter() + duty * period
        while time.perf_counter() < end:
            os.pwrite(fd, block, 0)
            os.fsync(fd)
        if duty < 1:
            time.sleep(period * (1 - duty))
finally:
    os.unlink(path)
"""


def device_irqs() -> dict[int, tuple[int, str]]:
    """IRQ number -> (interrupts so far over every CPU, name), from /proc/interrupts."""
    out = {}
    lines = Path("/proc/interrupts").read_text().splitlines()
    ncpu = len(lines[0].split())
    for line in lines[1:]:
        head, _, rest = line.partition(":")
        if not head.strip().isdigit():
            continue
        cols = rest.split()
        counts = [int(c) for c in cols[:ncpu] if c.isdigit()]
        out[int(head)] = (sum(counts), " ".join(cols[ncpu:]))
    return out


class IrqAffinity(Fault):
    """Move device IRQs onto the rank's CPU through /proc/irq/N/smp_affinity, pin the rank
    there, and keep a disk writer (on another CPU) busy so those IRQs really fire.

    `irqs`: substrings of IRQ names to move (default: every device IRQ that has fired);
    IRQs that refuse a new mask are skipped and listed. Old masks are restored on stop."""
    kind = "irq_affinity"

    def __init__(self, pid: int, strength: float, irqs: list[str] | None = None, cpu: int | None = None,
                 io_load: bool = True, scratch_dir: str = "/var/tmp"):
        super().__init__()
        self.pid, self.duty = pid, _check_strength(self.kind, strength)
        self.names, self.cpu, self.io_load, self.scratch_dir = irqs, cpu, io_load, scratch_dir
        self.saved: dict[int, str] = {}
        self.refused: list[int] = []
        self._procs, self._pinning = _Processes(), _Pinning(pid)

    def start(self) -> None:
        self.cpu = last_cpu(self.pid) if self.cpu is None else self.cpu
        mask = format(1 << self.cpu, "x")
        for irq, (count, name) in sorted(device_irqs().items()):
            if self.names is not None and not any(n in name for n in self.names):
                continue
            if self.names is None and count == 0:
                continue
            f = Path(f"/proc/irq/{irq}/smp_affinity")
            try:
                old = f.read_text().strip()
                f.write_text(mask)
                self.saved[irq] = old
            except OSError:
                self.refused.append(irq)
        if not self.saved:
            raise FaultError(f"irq_affinity: no IRQ accepted a new affinity (refused: {self.refused}); "
                             "the fault would do nothing")
        self._pinning.pin(self.cpu)
        if self.io_load:
            others = sorted(os.sched_getaffinity(0) - {self.cpu})
            self._procs.spawn(DISK_WRITER, os.path.join(self.scratch_dir, f"fleetscope-irq-{os.getpid()}.bin"),
                              str(self.duty), cpu=others[0] if others else None)
        super().start()

    def stop(self) -> None:
        self._procs.stop()
        for irq, old in self.saved.items():
            try:
                Path(f"/proc/irq/{irq}/smp_affinity").write_text(old)
            except OSError:
                pass  # the IRQ went away with its device
        self.saved.clear()
        self._pinning.undo()
        super().stop()

    def describe(self) -> dict:
        return {"kind": self.kind, "pid": self.pid, "cpu": self.cpu, "irqs": sorted(self.saved),
                "refused": self.refused, "io_duty": self.duty if self.io_load else 0}


THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


class ThpOff(Fault):
    """Transparent huge pages off for the whole node (`never`); the old mode is restored on stop.
    New anonymous memory then comes in 4 KiB pages: more TLB misses and page faults."""
    kind = "thp_off"

    def __init__(self, strength: float = 1.0, path: Path = THP_ENABLED):
        super().__init__()
        self.path = Path(path)
        self.saved: str | None = None

    def start(self) -> None:
        try:
            text = self.path.read_text()
        except OSError as e:
            raise FaultError(f"thp_off: cannot read {self.path}: {e}") from None
        if "[" not in text:
            raise FaultError(f"thp_off: unexpected contents of {self.path}: {text.strip()!r}")
        self.saved = text.split("[", 1)[1].split("]", 1)[0]
        if self.saved == "never":
            raise FaultError("thp_off: transparent huge pages are already off here; the fault would do nothing")
        try:
            self.path.write_text("never")
        except OSError as e:
            self.saved = None
            raise FaultError(f"thp_off: cannot write {self.path}: {e} (needs root)") from None
        super().start()

    def stop(self) -> None:
        if self.saved is not None:
            self.path.write_text(self.saved)
            self.saved = None
        super().stop()

    def describe(self) -> dict:
        return {"kind": self.kind, "file": str(self.path), "restores": self.saved}


def make_fault(kind: str, *, pid: int | None = None, rank: int | None = None, strength: float = 1.0,
               params: dict | None = None, control_dir: Path | None = None,
               relay: DelayRelay | None = None, outside: bool = False, nvml=None) -> Fault:
    """Build the injector for one target of a scenario's fault (pid: that rank's process).
    outside=True: a process beside the job, touching none of its ranks (competing_load only).
    nvml: the run's NVML stand-in (eval/nvml_standin.py), where the scenario loads one: a GPU fault then
    changes what NVML reports of the rank's GPU too."""
    params = dict(params or {})

    def need(what, value):
        if value is None:
            raise FaultError(f"fault {kind!r} needs {what}")
        return value

    if kind == "none":
        return Fault()
    if outside:
        if kind != "competing_load":
            raise FaultError(f"fault {kind!r} cannot run outside the job; only competing_load can")
        return CompetingLoad(None, strength, **{"pin_rank": False, **params})
    if kind in KNOB_KINDS:
        knob = WorkloadKnob(kind, need("control_dir (the workload's FLEETSCOPE_WORKLOAD_CONTROL_DIR)", control_dir),
                            need("rank", rank), strength, params)
        return GpuThrottle(knob, nvml, rank) if kind == "gpu_throttle" and nvml is not None else knob
    if kind == "link_delay":
        return LinkDelay(need("relay", relay), strength, **params)
    if kind == "thp_off":
        return ThpOff(strength, **params)
    if kind == "gpu_xid":
        try:
            return GpuXid(Crash(need("pid", pid)), nvml, need("rank", rank), **params)
        except TypeError as e:
            raise FaultError(f"fault 'gpu_xid': bad params {params}: {e}") from None
    classes = (CpuQuota, CompetingLoad, SoftirqStorm, MemoryPressure, Crash, IrqAffinity)
    cls = {c.kind: c for c in classes}.get(kind)
    if cls is None:
        raise FaultError(f"unknown fault kind {kind!r}; known: none, link_delay, thp_off, gpu_xid, "
                         f"{', '.join(sorted([*KNOB_KINDS, *(c.kind for c in classes)]))}")
    try:
        return cls(need("pid", pid), strength, **params)
    except TypeError as e:
        raise FaultError(f"fault {kind!r}: bad params {params}: {e}") from None
