"""Workload (b): a GPU-job stand-in. N rank processes drive the libcudart/libnccl stand-ins.

There is no GPU here. The C stand-ins for libcudart, libcuda and libnccl (fleetscope/eval/gpu_stub/)
export the real symbols, so the CUDA and NCCL uprobes fire on them. `launch()` builds them
and `gpu_standin_rank.c` (one process per rank, torchrun-style environment: RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID, FLEETSCOPE_JOB), which dlopen()s them
from a library directory and runs training-like steps. This module decides *how long*
each call takes: `plan_step()` (pure, tested, printed by `--plan`) turns the config and the
rank's fault knobs into per-call durations, and `stub_control()` writes them as the
stand-ins' runtime control file (GPU_STUB_CONTROL, re-read within 100 ms; see
fleetscope/eval/gpu_stub/stub_control.h). A fault therefore changes a running rank's call timings
with no restart and no change of its code path.

Per step (the defaults give about 9 steps/s):
  cudaMemcpy HtoD   batch_mb / h2d_gbps          (+ memcpy_stall extra_ms on the faulty rank)
  cudaLaunchKernel  x kernels, each kernel_us of GPU time (asynchronous: launch cost only)
  cudaMalloc+cudaFree  a 4 MiB workspace (in the rank program; not part of the plan)
  cudaMalloc        bytes_per_step, never freed  (gpu_memory_leak on the faulty rank)
  ncclAllReduce     grad_mb of float32: latency_us per hop, plus (slow_collective extra_ms)
                    and, with 2+ ranks, a real ring all-reduce of the bytes over loopback
                    TCP inside the call (ranks wait for each other: a straggler or a slow
                    link holds every rank up); with 1 rank, the modelled transfer time
  cudaStreamSynchronize  waits for the queued kernels: kernels * kernel_us
  host sleep        step_sleep_ms (input pipeline, optimizer on the host)

Faults come from the same per-rank control file as ddp_train.py
(FLEETSCOPE_WORKLOAD_CONTROL_DIR/rank<R>.json, written by benchmarks/eval/faults.py):
    {"memcpy_stall": {"extra_ms": 25}, "gpu_memory_leak": {"bytes_per_step": 16777216},
     "slow_collective": {"extra_ms": 20}}
A watcher thread in the launching process polls those files (every 100 ms) and rewrites
the rank's stand-in control file. The `link_delay` fault needs no knob: with 2+ ranks a
`fleetscope.eval.relay.DelayRelay` (pass-through until the fault) sits in front of every
rank, so every ring connection takes the same path (a relay in front of one rank alone made
that rank differ from its peers before any fault: its bytes arrived in more, smaller pieces,
3x the voluntary context switches). The one in front of `relay_rank` (default 1) is exposed
as `.relay`; the runner gives a link fault on rank r `relays[r]`.

    python -m fleetscope.eval.workloads.gpu_standin --plan
    python -m fleetscope.eval.workloads.gpu_standin --run --ranks 2 --duration-s 10
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fleetscope.eval.faults import KNOB_KINDS

HERE = Path(__file__).resolve().parent
RANK_SOURCE = HERE / "gpu_standin_rank.c"
CONTROL_ENV = "FLEETSCOPE_WORKLOAD_CONTROL_DIR"
EXTRA_KNOBS = {"link_delay", "slow_collective"}  # beyond faults.KNOB_KINDS
MALLOC_US, FREE_US = 20.0, 10.0  # host cost of cudaMalloc / cudaFree


@dataclass(frozen=True)
class StandinConfig:
    batch_mb: float = 16.0
    h2d_gbps: float = 12.0  # pinned-memory PCIe gen4 x16, roughly
    kernels: int = 40
    kernel_us: float = 1500.0
    kernel_launch_us: float = 5.0
    grad_mb: float = 8.0  # small: the stand-in's bytes may really cross a Python relay
    link_gbps: float = 20.0
    allreduce_latency_us: float = 50.0
    step_sleep_ms: float = 30.0


@dataclass(frozen=True)
class Call:
    api: str
    duration_us: float  # how long the call should block the calling thread
    args: dict = field(default_factory=dict)


def _ring_allreduce_us(cfg: StandinConfig, world: int, link_gbps: float, extra_latency_us: float = 0.0) -> float:
    """Ring all-reduce: 2(n-1)/n of the bytes cross each link, plus 2(n-1) latency hops."""
    hops = 2 * (world - 1)
    bytes_on_link = cfg.grad_mb * 1e6 * hops / world
    return hops * (cfg.allreduce_latency_us + extra_latency_us) + bytes_on_link * 8 / (link_gbps * 1e9) * 1e6


def plan_step(cfg: StandinConfig, world: int, knobs: dict | None = None) -> list[Call]:
    """The calls of one step, in order, for a rank whose control file holds `knobs`.

    ncclAllReduce's duration is the modelled one (latency hops + bytes over the link);
    with a real ring (`stub_control(ring=True)`) the bytes' time comes from the ring instead."""
    knobs = knobs or {}
    unknown = set(knobs) - {k for k, _, _ in KNOB_KINDS.values()} - EXTRA_KNOBS
    if unknown:
        raise ValueError(f"unknown stand-in knob(s) {sorted(unknown)}")
    batch_bytes = int(cfg.batch_mb * 1e6)
    memcpy_us = batch_bytes * 8 / (cfg.h2d_gbps * 1e9) * 1e6
    memcpy_us += 1000.0 * knobs.get("memcpy_stall", {}).get("extra_ms", 0.0)
    calls = [Call("cudaMemcpy", memcpy_us, {"bytes": batch_bytes, "kind": "HtoD"})]
    calls += [Call("cudaLaunchKernel", cfg.kernel_launch_us, {"gpu_us": cfg.kernel_us})] * cfg.kernels
    leak = int(knobs.get("gpu_memory_leak", {}).get("bytes_per_step", 0))
    if leak:
        calls.append(Call("cudaMalloc", MALLOC_US, {"bytes": leak, "free": False}))
    link = knobs.get("link_delay", {})
    link_gbps = cfg.link_gbps
    if link.get("bandwidth_mbps"):
        link_gbps = min(link_gbps, link["bandwidth_mbps"] / 1000.0)
    slow_us = 1000.0 * knobs.get("slow_collective", {}).get("extra_ms", 0.0)
    calls.append(Call("ncclAllReduce",
                      _ring_allreduce_us(cfg, world, link_gbps, 1000.0 * link.get("delay_ms", 0.0)) + slow_us,
                      {"bytes": int(cfg.grad_mb * 1e6), "op": "sum", "dtype": "float32", "extra_us": slow_us}))
    # gpu_throttle: the clocks drop, so each kernel takes (1 + kernel_slowdown) times as long
    gpu_us = cfg.kernels * cfg.kernel_us * (1.0 + knobs.get("gpu_throttle", {}).get("kernel_slowdown", 0.0))
    calls.append(Call("cudaStreamSynchronize", max(0.0, gpu_us - cfg.kernels * cfg.kernel_launch_us)))
    calls.append(Call("sleep", cfg.step_sleep_ms * 1000.0))
    return calls


def step_time_us(calls: list[Call]) -> float:
    return sum(c.duration_us for c in calls)


def stub_control(cfg: StandinConfig, world: int, knobs: dict | None = None, ring: bool = False) -> str:
    """The stand-ins' runtime control file (fleetscope/eval/gpu_stub/stub_control.h) for one rank.

    ring=True: the ranks exchange the gradient bytes over TCP inside ncclAllReduce, so its
    stub delay keeps only the per-hop latency and the slow_collective extra."""
    calls = plan_step(cfg, world, knobs)
    delays: dict[str, int] = {}
    for c in calls:
        if c.api == "sleep":
            continue
        us = c.duration_us
        if c.api == "ncclAllReduce" and ring:
            us = 2 * (world - 1) * cfg.allreduce_latency_us + c.args["extra_us"]
        delays.setdefault(c.api, round(us))
    delays.setdefault("cudaMalloc", round(MALLOC_US))  # the rank's per-step workspace, allocated and freed
    delays.setdefault("cudaFree", round(FREE_US))
    leak = sum(c.args["bytes"] for c in calls if c.api == "cudaMalloc" and not c.args.get("free", True))
    return (f"delay_us {','.join(f'{k}={v}' for k, v in delays.items())}\n"
            f"knob leak_bytes={leak}\n")


# -- building and running ----------------------------------------------------
def build(out: Path) -> Path:
    """Compile the stand-in libraries (fleetscope/eval/gpu_stub) and the rank program into `out`."""
    from fleetscope.eval.gpu_stub.build import build as build_stubs
    build_stubs(out)
    subprocess.run(["gcc", "-O2", "-o", str(out / "gpu_standin_rank"), str(RANK_SOURCE), "-ldl"], check=True)
    return out


def free_port() -> int:
    from fleetscope.eval.workloads.launch import free_port as fp
    return fp()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class KnobWatcher(threading.Thread):
    """Polls each rank's fault-knob file (FLEETSCOPE_WORKLOAD_CONTROL_DIR/rank<R>.json) and
    rewrites that rank's stand-in control file when the knobs change."""

    def __init__(self, control_dir: Path | None, stub_files: dict[int, Path], cfg: StandinConfig, world: int,
                 ring: bool, period_s: float = 0.1):
        super().__init__(daemon=True, name="gpu-standin-knobs")
        self.control_dir, self.stub_files, self.cfg, self.world, self.ring = control_dir, stub_files, cfg, world, ring
        self.period_s = period_s
        self.knobs: dict[int, dict] = {}
        self.seen: dict[int, set[str]] = {r: set() for r in stub_files}
        self.errors: list[str] = []  # unreadable or invalid knob files, with the reason
        self._mtimes: dict[int, int | None] = {}
        self._stop = threading.Event()
        for rank in stub_files:
            self._apply(rank, {})

    def _apply(self, rank: int, knobs: dict) -> None:
        try:
            text = stub_control(self.cfg, self.world, knobs, self.ring)
        except ValueError as e:
            self.errors.append(f"rank {rank}: {e}")
            print(f"gpu_standin: rank {rank}: {e}; knobs ignored", file=sys.stderr)
            return
        _write_atomic(self.stub_files[rank], text)
        self.knobs[rank] = knobs
        self.seen[rank] |= set(knobs)

    def poll_once(self) -> None:
        if self.control_dir is None:
            return
        for rank in self.stub_files:
            path = self.control_dir / f"rank{rank}.json"
            try:
                mtime = path.stat().st_mtime_ns
            except FileNotFoundError:
                mtime = None
            if mtime == self._mtimes.get(rank, None) and rank in self._mtimes:
                continue
            self._mtimes[rank] = mtime
            if mtime is None:
                self._apply(rank, {})
                continue
            try:
                knobs = json.loads(path.read_text())
            except (OSError, ValueError) as e:  # keep the old knobs, say so
                self.errors.append(f"rank {rank}: cannot read {path}: {e}")
                print(f"gpu_standin: cannot read {path}: {e}", file=sys.stderr)
                continue
            self._apply(rank, knobs)

    def run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.poll_once()

    def stop(self) -> None:
        self._stop.set()


class _Ranks:
    """The rank processes as one `proc` for the runner: poll() is not None once any rank has ended."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs = procs
        self.pid = procs[0].pid if procs else 0

    def poll(self):
        codes = [p.poll() for p in self.procs]
        ended = [c for c in codes if c is not None]
        return (next((c for c in ended if c != 0), ended[0])) if ended else None

    @property
    def returncode(self):
        return self.poll()


@dataclass
class StandinLaunch:
    procs: list[subprocess.Popen]
    run_id: str
    log_path: Path
    result_dir: Path
    work_dir: Path
    watcher: KnobWatcher
    relay: object | None = None  # fleetscope.eval.relay.DelayRelay in front of relay_rank, or None
    relays: list = field(default_factory=list)  # one in front of every rank (relay among them)

    @property
    def proc(self) -> _Ranks:
        return _Ranks(self.procs)

    @property
    def nprocs(self) -> int:
        return len(self.procs)

    def rank_pids(self, timeout_s: float = 30.0) -> dict[int, int]:
        """rank -> pid, once every rank has loaded the libraries and joined the ring ("loaded")."""
        deadline = time.monotonic() + timeout_s
        for rank, p in enumerate(self.procs):
            line = _readline(p, deadline - time.monotonic())
            if line != "loaded":
                self.stop()
                raise RuntimeError(f"gpu_standin rank {rank} did not start (said {line!r}, exit {p.poll()}); "
                                   f"log:\n{self._log_tail()}")
        return {rank: p.pid for rank, p in enumerate(self.procs)}

    def go(self) -> None:
        """Release ranks started with wait_for_go=True."""
        (self.work_dir / "go").touch()

    def wait(self, timeout_s: float) -> list[dict]:
        """Wait for the end; each rank's JSON result, sorted by rank."""
        deadline = time.monotonic() + timeout_s
        try:
            for p in self.procs:
                p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            raise TimeoutError(f"gpu_standin still running after {timeout_s} s; stopped it. Log:\n{self._log_tail()}") from None
        return self._results()

    def _results(self) -> list[dict]:
        files = sorted(self.result_dir.glob("rank*.json"))
        results = [json.loads(f.read_text()) for f in files]
        codes = [p.returncode for p in self.procs]
        if any(codes) or len(results) != len(self.procs):
            raise RuntimeError(f"gpu_standin ranks exited with {codes} and {len(results)} of {len(self.procs)} "
                               f"results. Log:\n{self._log_tail()}")
        for r in results:
            r["faults_seen"] = sorted(self.watcher.seen.get(r["rank"], ()))
        return sorted(results, key=lambda r: r["rank"])

    def stop(self) -> None:
        """SIGTERM every rank (each ends after its current step), SIGKILL after 10 s; stop the relay."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout:
                p.stdout.close()
        self.watcher.stop()
        for relay in self.relays:
            relay.stop()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.work_dir, ignore_errors=True)

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text()[-3000:]
        except OSError:
            return "(no log)"


def _readline(p: subprocess.Popen, timeout_s: float) -> str:
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(p.stdout.readline()), daemon=True)
    t.start()
    t.join(max(0.0, timeout_s))
    return box[0].strip() if box else "(nothing within the timeout)"


def launch(ranks: int, *, env: dict | None = None, log_path: Path | None = None, cfg: StandinConfig | None = None,
           steps: int = 0, duration_s: float = 86400.0, relay_rank: int | None = 1, bindir: Path | None = None,
           wait_for_go: bool = False, run_id: str | None = None, rank_args: dict | None = None,
           **overrides) -> StandinLaunch:
    """Build the stand-ins (unless `bindir` holds them) and start `ranks` rank processes.

    `overrides` are StandinConfig fields (e.g. grad_mb=1). The knob files are read from
    env's (or the process's) FLEETSCOPE_WORKLOAD_CONTROL_DIR. relay_rank: put a pass-through
    DelayRelay in front of that rank (None: no relay; ignored with one rank). rank_args: rank ->
    {"step_sleep_ms": ms}, a rank whose host-side step differs by design."""
    if not 1 <= ranks <= 16:
        raise ValueError(f"ranks must be 1..16, got {ranks}")
    cfg = cfg or StandinConfig(**overrides)
    run_id = run_id or (env or {}).get("FLEETSCOPE_JOB") or f"gpu-standin-{uuid.uuid4().hex[:8]}"
    work = Path(tempfile.mkdtemp(prefix=f"{run_id}-"))
    bindir = Path(bindir) if bindir else build(work / "bin")
    result_dir = work / "results"
    result_dir.mkdir()
    log_path = Path(log_path or work / "workload.log")
    full_env = {**os.environ, **(env or {})}
    control = full_env.get(CONTROL_ENV)
    ring = ranks > 1
    stub_files = {r: work / f"stub_rank{r}.ctl" for r in range(ranks)}
    watcher = KnobWatcher(Path(control) if control else None, stub_files, cfg, ranks, ring)
    watcher.poll_once()
    ports = [free_port() for _ in range(ranks)]
    relays: list = []
    if ring and relay_rank is not None:
        if not 0 <= relay_rank < ranks:
            raise ValueError(f"relay_rank {relay_rank} is not a rank of {ranks}")
        from fleetscope.eval.relay import DelayRelay
        relays = [DelayRelay(("127.0.0.1", ports[r])).start() for r in range(ranks)]
    relay = relays[relay_rank] if relays else None
    master_port = free_port()
    log = open(log_path, "ab")
    procs = []
    try:
        for r in range(ranks):
            nxt = (r + 1) % ranks
            host, port = relays[nxt].address if relays else ("127.0.0.1", ports[nxt])
            rank_env = {**full_env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(ranks),
                        "LOCAL_WORLD_SIZE": str(ranks), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(master_port), "TORCHELASTIC_RUN_ID": run_id,
                        "FLEETSCOPE_JOB": full_env.get("FLEETSCOPE_JOB", run_id),
                        "GPU_STUB_CONTROL": str(stub_files[r]), "FLEETSCOPE_WORKLOAD_RESULT_DIR": str(result_dir)}
            if wait_for_go:
                rank_env["GPU_STANDIN_GO_FILE"] = str(work / "go")
            args = [str(bindir / "gpu_standin_rank"), str(bindir), str(steps), str(duration_s), str(cfg.kernels),
                    str(int(cfg.batch_mb * 1e6)), str(int(cfg.grad_mb * 1e6)),
                    str(int((rank_args or {}).get(r, {}).get("step_sleep_ms", cfg.step_sleep_ms) * 1000)),
                    str(ports[r]), f"{host}:{port}"]
            procs.append(subprocess.Popen(args, env=rank_env, stdout=subprocess.PIPE, stderr=log, text=True,
                                          start_new_session=True))
    except BaseException:
        for p in procs:
            p.kill()
        for r in relays:
            r.stop()
        raise
    finally:
        log.close()
    watcher.start()
    return StandinLaunch(procs, run_id, log_path, result_dir, work, watcher, relay, relays)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f, default in asdict(StandinConfig()).items():
        p.add_argument(f"--{f.replace('_', '-')}", type=type(default), default=default)
    p.add_argument("--world", type=int, default=2, help="ranks, for --plan")
    p.add_argument("--knobs", default="{}", help='a control-file body, e.g. \'{"memcpy_stall": {"extra_ms": 25}}\'')
    p.add_argument("--plan", action="store_true", help="print one step's call plan as JSON and exit")
    p.add_argument("--run", action="store_true", help="run the ranks and print their results")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--duration-s", type=float, default=10.0)
    p.add_argument("--steps", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = StandinConfig(**{f: getattr(args, f) for f in asdict(StandinConfig())})
    if args.run:
        run = launch(args.ranks, cfg=cfg, steps=args.steps, duration_s=args.duration_s)
        try:
            pids = run.rank_pids()
            print(json.dumps({"ranks": pids, "relay": run.relay.address if run.relay else None}), flush=True)
            for r in run.wait(args.duration_s + 60 if not args.steps else 600):
                print(json.dumps(r))
        finally:
            run.cleanup()
        return 0
    calls = plan_step(cfg, args.world, json.loads(args.knobs))
    print(json.dumps({"step_time_ms": round(step_time_us(calls) / 1000, 3),
                      "stub_control": stub_control(cfg, args.world, json.loads(args.knobs), ring=args.world > 1),
                      "calls": [asdict(c) for c in calls]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
