"""What the bench watches from outside the processes: CPU seconds and RSS from /proc, the
machine's busy share, a consumer group's committed lag, and the code a run measured."""
from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()  # after comm: state, ppid, pgrp, ...
    except (OSError, IndexError):
        return None


def group_pids(pgid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            f = _stat_fields(int(name))
            if f and int(f[2]) == pgid:
                out.append(int(name))
    return out


class ProcProbe:
    """CPU seconds (utime+stime, all threads) and RSS of a set of processes."""

    def __init__(self, name: str, pids_fn):
        self.name, self.pids_fn = name, pids_fn
        self.pids = pids_fn()

    def cpu_s(self) -> float:
        ticks = 0
        for pid in self.pids:
            f = _stat_fields(pid)
            if f:
                ticks += int(f[11]) + int(f[12])
        return ticks / CLK_TCK

    def rss_mb(self) -> float:
        kb = 0
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            kb += int(line.split()[1])
            except OSError:
                pass
        return kb / 1024


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies over all CPUs, from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


class ResourceWindow:
    """CPU % (100 = one core) and RSS of each probe between start() and stop()."""

    def __init__(self, probes: list[ProcProbe]):
        self.probes = probes

    def start(self) -> None:
        self.t = time.monotonic()
        self.cpu0 = {p.name: p.cpu_s() for p in self.probes}
        self.mach0 = machine_busy()
        self.rss_max = {p.name: p.rss_mb() for p in self.probes}

    def sample(self) -> None:
        for p in self.probes:
            self.rss_max[p.name] = max(self.rss_max[p.name], p.rss_mb())

    def stop(self) -> dict:
        dt = time.monotonic() - self.t
        busy1, total1 = machine_busy()
        out = {p.name: {"cpu_pct": round(100 * (p.cpu_s() - self.cpu0[p.name]) / dt, 1),
                        "rss_mb_max": round(self.rss_max[p.name], 1), "rss_mb_end": round(p.rss_mb(), 1)}
               for p in self.probes}
        cores = os.cpu_count() or 1
        out["machine_busy_pct_of_all_cores"] = round(100 * (busy1 - self.mach0[0]) / max(total1 - self.mach0[1], 1), 1)
        out["machine_cores"] = cores
        return out


class CommittedLag:
    """The worker group's committed offsets against the high watermarks, per partition."""

    def __init__(self, bootstrap: str, group: str, topic: str, partitions: int):
        from confluent_kafka import Consumer, TopicPartition
        conf = {"bootstrap.servers": bootstrap, "enable.auto.commit": False, "log.connection.close": False}
        self._c = Consumer({**conf, "group.id": group})
        self._end_reader = Consumer({**conf, "group.id": f"{group}-end-reader", "fetch.wait.max.ms": 10})
        self._tps = [TopicPartition(topic, p) for p in range(partitions)]

    def partitions(self) -> list[dict] | None:
        """`high` is the partition's true end, read (fleetscope.topic_reader.committed_and_ends): tansu reports less."""
        from fleetscope.topic_reader import committed_and_ends
        try:
            return [{"partition": p, "committed": committed, "low": low, "high": high}
                    for p, committed, low, high in committed_and_ends(self._c, self._end_reader, self._tps)]
        except Exception:  # best effort: a probe failure is reported as null
            return None

    def lag(self) -> int | None:
        parts = self.partitions()
        return None if parts is None else sum(p["high"] - (p["committed"] if p["committed"] >= 0 else p["low"])
                                              for p in parts)

    def close(self) -> None:
        self._c.close()
        self._end_reader.close()



def high_watermarks(lag_probe: "CommittedLag") -> list[int]:
    return [p["high"] for p in lag_probe.partitions() or []]



def code_state() -> dict:
    """The commit and any uncommitted changes outside benchmarks/: the code this run measured.
    Others commit while benchmarks run; a change between start and end makes the run suspect."""
    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    dirty = git("status", "--porcelain", "--", ".", ":(exclude)benchmarks")
    diff = git("diff", "HEAD", "--", ".", ":(exclude)benchmarks")
    return {"commit": git("rev-parse", "HEAD"), "uncommitted_outside_benchmarks": (dirty or "").splitlines(),
            "diff_sha1": hashlib.sha1((diff or "").encode()).hexdigest()[:12]}


