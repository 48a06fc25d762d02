"""The /proc process sampler against real processes, and its features through the real windowing code.

Children are real Python processes (a CPU burner, a page toucher, sleepers
with and without a launcher's RANK); nothing is stubbed. The machine is shared,
so CPU and fault assertions use generous lower bounds.
"""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from fleetscope.config import load
from fleetscope.schema import validate
from fleetscope.topics import RAW_SOURCES, all_topics
from fleetscope.producers.identity import IdentityResolver, IdentityRules
from fleetscope.producers.process_sampler import ProcessSampler, parse_stat, read_file
from fleetscope.producers.tracers.discovery import TargetSpec
from fleetscope.streams.diagnosis.subsystems import subsystem_of
from fleetscope.streams.features import window_features
from fleetscope.streams.windows import WindowAssembler
from support.processes import spawn, wait_until  # noqa: F401 (spawn is a fixture)

BURN = "import time\nend = time.time() + 30\nwhile time.time() < end: pass"
# Maps fresh anonymous memory and writes one byte per page, over and over: minor faults grow.
TOUCH = ("import mmap, time\nend = time.time() + 30\n"
         "while time.time() < end:\n"
         "    m = mmap.mmap(-1, 8 << 20)\n"
         "    for i in range(0, 8 << 20, 4096): m[i] = 1\n"
         "    m.close()\n")
SLEEP = "import time; time.sleep(30)"
# prctl(PR_SET_NAME): a comm with spaces and ')' (15 bytes at most).
RENAME = ("import ctypes, time\n"
          "ctypes.CDLL(None).prctl(15, ctypes.c_char_p(b'we) ird (na)me'), 0, 0, 0)\n"
          "time.sleep(30)")
WEIRD_COMM = "we) ird (na)me"


@pytest.fixture
def job():
    return f"proctest-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def children(spawn, job):  # noqa: F811 (the fixture imported above)
    """Real Python children (ranked when given a rank), through test_identity's spawn: it waits for the
    exec (before it, /proc shows a forked pytest with pytest's environment) and kills and reaps them."""

    def start(code: str, rank: int | None = None, ready=None) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "FLEETSCOPE_JOB")}
        if rank is not None:
            env.update(RANK=str(rank), WORLD_SIZE="2", FLEETSCOPE_JOB=job)
        proc = spawn(env, [sys.executable, "-c", code])
        if ready is not None:
            wait_until(lambda: ready(proc.pid))
        return proc

    return start


def _comm(pid: int) -> str:
    try:
        return read_file(f"/proc/{pid}/comm").decode().strip()
    except OSError:
        return ""


_libc = ctypes.CDLL(None, use_errno=True)
TICK_NS = 1e9 / os.sysconf("SC_CLK_TCK")


def cpu_clock_ns(pid: int) -> int:
    """The process's CPU time from its POSIX CPU clock: the kernel's own count, not /proc's."""
    clock = ctypes.c_int()
    if _libc.clock_getcpuclockid(pid, ctypes.byref(clock)) != 0:
        raise OSError(ctypes.get_errno(), "clock_getcpuclockid")
    return time.clock_gettime_ns(clock.value)


def until_cpu_advances(pids, ns: float) -> None:
    """Wait until each process has run `ns` more CPU time: on a loaded machine a wall-clock sleep promises none."""
    start = {pid: cpu_clock_ns(pid) for pid in pids}
    wait_until(lambda: all(cpu_clock_ns(pid) - start[pid] >= ns for pid in pids), timeout_s=30)


def sampler(targets=None) -> ProcessSampler:
    return ProcessSampler("node-a", IdentityResolver(IdentityRules(), host="node-a"), targets=targets, poll_s=0.0)


def rows(batch) -> list[dict]:
    """The batch's rows as dicts, strings decoded."""
    c = batch.columns
    out = []
    for i in range(batch.count):
        row = {}
        for name, col in c.items():
            row[name] = col.values[col.codes[i]] if hasattr(col, "codes") else col[i].item()
        out.append(row)
    return out


def of_pid(batch, pid: int) -> dict[str, dict]:
    return {r["metric"]: r for r in rows(batch) if r["pid"] == pid} if batch is not None else {}


def test_counters_of_a_cpu_burner_and_a_page_toucher(children):
    burner, toucher = children(BURN, rank=0), children(TOUCH, rank=1)
    s = sampler()
    c1 = cpu_clock_ns(burner.pid)
    t1 = time.time_ns()
    first = s.sample(t1)
    c1_after = cpu_clock_ns(burner.pid)
    validate(first)
    for pid in (burner.pid, toucher.pid):  # first read: gauges only
        assert set(of_pid(first, pid)) == {"proc.rss_bytes", "proc.threads", "proc.last_cpu"}
        last = of_pid(first, pid)["proc.last_cpu"]   # the CPU it ran on: device cpu<N>, value N
        assert last["device"] == f"cpu{int(last['value'])}" and int(last["value"]) in os.sched_getaffinity(pid)
    until_cpu_advances((burner.pid, toucher.pid), 0.2e9)
    c2 = cpu_clock_ns(burner.pid)
    t2 = time.time_ns()
    second = s.sample(t2)
    c2_after = cpu_clock_ns(burner.pid)
    validate(second)
    burn, touch = of_pid(second, burner.pid), of_pid(second, toucher.pid)
    wall = burn["proc.cpu_ns"]["interval_ns"]
    assert wall == t2 - t1  # the time between the two reads
    # /proc counts in clock ticks, each of utime and stime rounded down: a few ticks of slack per read
    assert c2 - c1_after - 4 * TICK_NS <= burn["proc.cpu_ns"]["value"] <= c2_after - c1 + 4 * TICK_NS
    assert burn["proc.cpu_ns"]["value"] > 0.1e9
    assert touch["proc.minflt"]["value"] > 100  # 2048 pages per 8 MiB pass; 0.2 s of CPU makes many passes
    for metric in ("proc.cpu_ns", "proc.minflt", "proc.majflt", "proc.vol_ctx", "proc.invol_ctx",
                   "proc.read_bytes", "proc.write_bytes"):
        assert burn[metric]["interval_ns"] == wall and burn[metric]["value"] >= 0
    assert burn["proc.rss_bytes"]["interval_ns"] == 0 and burn["proc.rss_bytes"]["value"] > 1 << 20
    assert burn["proc.threads"]["value"] == 1
    # identity as the resolver sees it; a process's rows are its own series
    assert {(r["tenant"], r["job"], r["rank"], r["device"]) for m, r in burn.items() if m != "proc.last_cpu"} == \
        {("default", burn["proc.cpu_ns"]["job"], 0, f"pid{burner.pid}")}
    assert burn["proc.last_cpu"]["rank"] == 0 and burn["proc.last_cpu"]["device"].startswith("cpu")
    assert touch["proc.cpu_ns"]["rank"] == 1 and touch["proc.cpu_ns"]["job"] == burn["proc.cpu_ns"]["job"]
    assert s.stats()["proc_read_errors"] == 0


def test_default_targets_are_rank_processes_only(children):
    ranked, plain = children(SLEEP, rank=3), children(SLEEP)
    s = sampler()
    batch = s.sample()
    assert of_pid(batch, ranked.pid) and not of_pid(batch, plain.pid)
    assert ranked.pid in s.watcher.current and plain.pid not in s.watcher.current
    assert os.getpid() not in s.watcher.current
    assert s.stats()["proc_pids"] >= 1


def test_rescan_at_most_every_poll_s(children):
    now = [1000.0]
    s = ProcessSampler("node-a", IdentityResolver(host="node-a"), poll_s=1.0, clock=lambda: now[0])
    s.sample()
    late = children(SLEEP, rank=0)
    now[0] += 0.5
    assert not of_pid(s.sample(), late.pid)  # no rescan yet
    now[0] += 0.5
    assert of_pid(s.sample(), late.pid)


def test_reads_at_most_every_min_interval_whatever_the_tick(children):
    rank = children(SLEEP, rank=0)
    now = [1000.0]
    s = ProcessSampler("node-a", IdentityResolver(host="node-a"), targets=TargetSpec(pids=(rank.pid,)),
                       clock=lambda: now[0], min_interval_s=1.0)
    assert of_pid(s.sample(), rank.pid)
    for _ in range(8):  # 100 ms ticks: nothing read, nothing sent
        now[0] += 0.1
        assert s.sample() is None
    now[0] += 0.1  # 0.9 s: a drift-free 1 s tick a little early still reads
    assert of_pid(s.sample(), rank.pid)
    from fleetscope.config import Config, ConfigError
    with pytest.raises(ConfigError, match="proc_interval_s"):
        Config(proc_interval_s=0.01).validate()
    # never less than twice per window: a window without proc rows would mask those features
    assert ProcessSampler.from_config(Config(window_s=0.5), IdentityResolver(host="node-a")).min_interval_s == 0.25
    assert ProcessSampler.from_config(Config(window_s=10), IdentityResolver(host="node-a")).min_interval_s == 1.0


def test_process_exiting_between_samples_is_dropped_and_counted(children):
    gone, stays = children(SLEEP, rank=0), children(SLEEP, rank=1)
    s = sampler(TargetSpec(pids=(gone.pid, stays.pid)))
    assert of_pid(s.sample(), gone.pid)
    gone.kill()
    gone.wait()
    batch = s.sample()
    assert not of_pid(batch, gone.pid) and of_pid(batch, stays.pid)
    assert s.stats()["proc_vanished"] == 1 and s.stats()["proc_read_errors"] == 0
    s.sample()
    assert s.stats()["proc_vanished"] == 1  # counted once


def test_zombie_is_dropped_not_read(children):
    zombie = children(SLEEP, rank=0)
    s = sampler(TargetSpec(pids=(zombie.pid,)))
    s.sample()
    zombie.kill()  # not reaped yet: a zombie until wait()
    wait_until(lambda: read_file(f"/proc/{zombie.pid}/stat").split(b") ")[-1][:1] == b"Z")
    assert not of_pid(s.sample(), zombie.pid)
    assert s.stats()["proc_vanished"] == 1


def test_comm_with_spaces_and_parentheses(children):
    weird = children(RENAME, rank=0, ready=lambda pid: _comm(pid) == WEIRD_COMM)
    raw = read_file(f"/proc/{weird.pid}/stat")
    assert f"({WEIRD_COMM})".encode() in raw
    starttime, _, _, _, threads, rss_pages, _ = parse_stat(raw)
    status = read_file(f"/proc/{weird.pid}/status").decode()
    assert threads == int(status.split("Threads:")[1].split()[0])
    assert rss_pages * os.sysconf("SC_PAGE_SIZE") == pytest.approx(
        int(status.split("VmRSS:")[1].split()[0]) * 1024, rel=0.2)
    # name targeting, as tracing's trace_name does
    s = sampler(TargetSpec(name_pattern=r"we\) ird"))
    s.sample()
    time.sleep(0.05)
    got = of_pid(s.sample(), weird.pid)
    assert got["proc.threads"]["value"] == threads and got["proc.cpu_ns"]["value"] >= 0
    assert s.stats()["proc_read_errors"] == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another user")
def test_without_root_io_denied_is_counted_once_and_the_rest_published(children):
    target = children(SLEEP, rank=0)  # owned by root
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # the sampler as an unprivileged user, in a forked copy of this process
        try:
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            s = sampler(TargetSpec(pids=(target.pid,)))
            batches = [s.sample(time.time_ns()), (time.sleep(0.05), s.sample(time.time_ns()))[1]]
            out = {"metrics": sorted(of_pid(batches[1], target.pid)), "stats": s.stats()}
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        got = json.loads(f.read() or "{}")
    os.waitpid(child, 0)
    assert got["stats"]["proc_io_denied"] == 1 and got["stats"]["proc_read_errors"] == 0
    assert got["metrics"] == sorted(["proc.cpu_ns", "proc.minflt", "proc.majflt", "proc.vol_ctx", "proc.invol_ctx",
                                     "proc.rss_bytes", "proc.threads", "proc.last_cpu"])


def test_features_from_real_samples_through_windows(children):
    burner, worker = children(BURN, rank=0), children(SLEEP, rank=0)
    toucher = children(TOUCH, rank=1)
    s = sampler()
    assembler = WindowAssembler(window_s=3600.0, allowed_lateness_s=0, idle_close_s=3600)
    stamps, cpu = [], []
    for i in range(4):
        if i:
            until_cpu_advances((burner.pid, toucher.pid), 0.05e9)
        before = cpu_clock_ns(burner.pid) + cpu_clock_ns(worker.pid)
        stamps.append(time.time_ns())
        batch = s.sample(stamps[-1])
        cpu.append((before, cpu_clock_ns(burner.pid) + cpu_clock_ns(worker.pid)))
        validate(batch)
        assembler.add(batch, None)
    windows = {w.key[3]: w for w in assembler.pop_closed(force=True) if w.key[1] == batch_job(batch, burner.pid)}
    rank0, rank1 = window_features(windows[0]), window_features(windows[1])
    # CPU seconds per second over the sampled span, against the kernel's CPU clocks over about that span
    span_s = (stamps[-1] - stamps[0]) / 1e9
    sampled_ns = rank0["proc_cpu_cores"] * span_s * 1e9
    assert cpu[-1][0] - cpu[0][1] - 4 * TICK_NS <= sampled_ns <= cpu[-1][1] - cpu[0][0] + 4 * TICK_NS
    assert rank0["proc_cpu_cores"] > 0
    assert rank0["proc_threads"] == 2  # the burner's and its sleeping sibling's threads, summed
    assert rank0["proc_rss_bytes"] > 2 * (1 << 20)
    assert rank1["proc_minflt_per_s"] > 100
    for f in (rank0, rank1):
        for name in ("proc_majflt_per_s", "proc_vol_ctx_per_s", "proc_invol_ctx_per_s", "proc_read_bytes_per_s",
                     "proc_write_bytes_per_s"):
            assert name in f and f[name] >= 0
        assert not any(k.startswith(("offcpu", "cuda_", "cpu_busy")) for k in f)  # no such sources: masked
    assert worker.pid in s.watcher.current


def batch_job(batch, pid: int) -> str:
    return next(r["job"] for r in rows(batch) if r["pid"] == pid)


def test_first_read_gives_gauges_and_masks_rates(children):
    ranked = children(SLEEP, rank=0)
    s = sampler(TargetSpec(pids=(ranked.pid,)))
    assembler = WindowAssembler(window_s=3600.0, allowed_lateness_s=0, idle_close_s=3600)
    assembler.add(s.sample(time.time_ns()), None)
    (window,) = assembler.pop_closed(force=True)
    f = window_features(window)
    assert set(k for k in f if k.startswith("proc_")) == {"proc_rss_bytes", "proc_threads"}


def test_schema_topics_config_and_subsystems_know_proc():
    assert "proc" in RAW_SOURCES
    cfg = load(env={})
    assert cfg.proc_sampling is True and cfg.raw_topic("proc") in all_topics(cfg)
    assert load(env={"FLEETSCOPE_PROC_SAMPLING": "off"}).proc_sampling is False
    assert subsystem_of("proc_cpu_cores") == "cpu" and subsystem_of("proc_invol_ctx_per_s") == "cpu"
    assert subsystem_of("proc_majflt_per_s") == "host_memory" and subsystem_of("proc_rss_bytes") == "host_memory"
    assert subsystem_of("proc_write_bytes_per_s") == "storage"


def test_explicit_trace_targets_are_followed(children):
    plain = children(SLEEP)
    cfg = load(env={"FLEETSCOPE_TRACE_PIDS": str(plain.pid), "FLEETSCOPE_HOST": "node-a"})
    s = ProcessSampler.from_config(cfg, IdentityResolver(host="node-a"))
    got = of_pid(s.sample(), plain.pid)
    assert got and got["proc.threads"]["rank"] == -1  # not a rank: the node's identity columns
    assert np.all(np.array(sorted(s.watcher.current)) == [plain.pid])
