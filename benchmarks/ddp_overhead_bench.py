"""The node agent's overhead on workload (a): steps/s of real 2-rank PyTorch DDP training (gloo, CPU).

One training job runs for the whole bench: benchmarks/workloads/ddp_train.py as N ranks under
torchrun (benchmarks/workloads/launch.py), on Debian's /usr/bin/python3.11 with the venv's torch
on PYTHONPATH, so the USDT probes exist. Rank 0 prints its step count every second
(`--progress-s 1`), which times any stretch of the run. An embedded broker (tansu,
fleetscope.broker.EmbeddedBroker) runs for the whole bench, so the agent's batches really go out.

Blocks of three setups, in rounds; the order rotates each round (the machine is shared: drift and
neighbours hit every setup alike, and ratios are taken within a round):

  agent_off      no agent process;
  sampling_only  `python -m fleetscope agent` with host, per-process (/proc) and NVML sampling and
                 FLEETSCOPE_TRACE="" (no eBPF). NVML has no library on a machine without a GPU: the
                 sampler publishes one nvml.status row and stops; the JSON records what it said;
  full_tracing   the same agent with the default tracing config: trace = kernel, cuda, nccl, python,
                 torch (cuda/nccl find no library in a CPU job), trace_auto on, the governor at its
                 default budget.

A fresh agent (its own topic prefix) starts at the beginning of each agent block. The block waits
until the agent is publishing and, with tracing, until its tracers have attached to the ranks and
their sources are on the broker, then drops --warmup-s more (a governor period; the BPF compile and
probe calibration are not counted), and then measures --block-s: the job's steps/s (rank 0's
progress lines), the ranks' CPU per step, and the CPU of the agent, broker, torchrun and the rest of
the machine from /proc. After the block the agent is stopped with Ctrl-C (SIGINT), as a user would.

Reported per setup: median steps/s over blocks, the ratio to agent_off (paired within each round,
then the median of the rounds' ratios), slowdown %, the ranks' CPU per step and its ratio, the
agent's CPU % (100 = one core), and for full_tracing whether the slowdown is at most 2%.

Writes benchmarks/results/ddp_overhead.json. Run as root (eBPF):
  .venv/bin/python benchmarks/ddp_overhead_bench.py [--rounds 3 --block-s 50 --ranks 2]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from pipeline.probes import CLK_TCK, ProcProbe, code_state, machine_busy  # noqa: E402
from fleetscope.eval.workloads.launch import DEBIAN_PYTHON, launch, venv_site_packages  # noqa: E402
from fleetscope.broker import EmbeddedBroker, die_with_parent  # noqa: E402
from fleetscope.config import Config  # noqa: E402
from fleetscope.topics import RAW_SOURCES, all_topics, ensure_topics  # noqa: E402
from fleetscope.wire import decode  # noqa: E402

SETUPS = ("agent_off", "sampling_only", "full_tracing")
AGENT_OFF_SETTLE_S = 2.0  # no agent to warm up: only the last agent's exit to let pass
TRACED_SOURCES_EXPECTED = ("kernel", "python", "torch")  # what a gloo CPU job gives; cuda/nccl find no library


from fleetscope.eval.overhead import BASE, GOAL_SLOWDOWN_PCT, paired_ratios, rate_between, rotated, summarise  # noqa: E402,F401


# ---- the broker's topics ----------------------------------------------------------------------

def read_topic(bootstrap: str, topics: list[str]) -> tuple[list, dict[str, int]]:
    """Every batch on these topics so far, decoded, and each topic's message count. The consumer
    lives only for this read: an assigned consumer keeps fetching, and the broker's CPU with it."""
    from confluent_kafka import Consumer, TopicPartition

    from fleetscope.topic_reader import read_to_end
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"ddpov-{uuid.uuid4().hex[:8]}",
                         "enable.auto.commit": False, "fetch.wait.max.ms": 5, "log.connection.close": False})
    try:
        meta = consumer.list_topics(timeout=10).topics
        parts = [TopicPartition(t, p) for t in topics if t in meta for p in meta[t].partitions]
        messages: list = []
        read_to_end(consumer, parts, messages.append, timeout_s=30)  # past tansu's short end (topic_reader)
        counts = {t: sum(1 for m in messages if m.topic() == t) for t in topics if t in meta}
        return [decode(m.value(), m.headers()) for m in messages], counts
    finally:
        consumer.close()


def metric_rows(batch) -> list[tuple[str, str, float]]:
    """(metric, device, value) of a metric-shaped batch."""
    cols = batch.columns
    return list(zip(cols["metric"].to_numpy().tolist(), cols["device"].to_numpy().tolist(),
                    [float(v) for v in cols["value"]]))


# ---- the agent -------------------------------------------------------------------------------

class AgentProcess:
    """`python -m fleetscope agent` against the bench's broker, with its own topic prefix."""

    def __init__(self, setup: str, bootstrap: str, prefix: str, work: Path):
        self.setup, self.bootstrap = setup, bootstrap
        self.cfg = Config(topic_prefix=prefix)
        self.log_path = work / f"{prefix}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE_")}  # the defaults, then:
        env.update(FLEETSCOPE_KAFKA=bootstrap, FLEETSCOPE_TOPIC_PREFIX=prefix, FLEETSCOPE_NVML="true",
                   FLEETSCOPE_PROC_SAMPLING="true", FLEETSCOPE_DATA_DIR=str(work / prefix))
        if setup == "sampling_only":
            env["FLEETSCOPE_TRACE"] = ""
        ensure_topics(bootstrap, all_topics(self.cfg), self.cfg.partitions)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "fleetscope", "agent"], cwd=ROOT, env=env,
                                         stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        self.probe = ProcProbe("agent", lambda: [self.proc.pid])

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the agent ({self.setup}) exited with {self.proc.returncode}:\n"
                               f"{self.log_path.read_text()[-3000:]}")

    def read(self) -> tuple[dict[str, float], dict[str, int], list]:
        """The agent's last reported stats, messages per raw source, and its nvml rows, from the broker."""
        topics = {self.cfg.raw_topic(src): src for src in RAW_SOURCES}
        batches, counts = read_topic(self.bootstrap, list(topics))
        stats: dict[str, float] = {}
        nvml = set()
        for b in sorted(batches, key=lambda b: b.created_ns):
            if b.source == "agent":
                stats.update({m.removeprefix("agent."): v for m, _, v in metric_rows(b)})
            elif b.source == "nvml":
                nvml.update(metric_rows(b))
        return stats, {topics[t]: n for t, n in counts.items() if n}, sorted(nvml)

    def ready(self, ranks: int) -> tuple[bool, dict]:
        """Publishing; with tracing, attached to every rank with each expected traced source on the broker."""
        self.check()
        stats, sources, _ = self.read()
        if not stats:
            return False, {}
        if self.setup != "full_tracing":
            return True, {}
        seen = [s for s in TRACED_SOURCES_EXPECTED if s in sources]
        ok = stats.get("trace_targets", 0) >= ranks and len(seen) == len(TRACED_SOURCES_EXPECTED)
        return ok, {"trace_targets": stats.get("trace_targets"), "traced_sources_seen": seen}

    def report(self) -> dict:
        """What went out and what the agent said about itself, read from the broker."""
        stats, sources, nvml = self.read()
        keep = ("batches_sent", "events_sent", "dropped_events", "delivery_errors", "spooled", "proc_pids",
                "trace_targets", "trace_tracers_running", "trace_tracers_unavailable", "trace_errors",
                "trace_hit_cost_ns", "trace_budget_used_frac", "trace_samples_deferred")
        out = {k: stats[k] for k in keep if k in stats}
        out["trace_duty"] = {k.removeprefix("trace_duty."): round(v, 4) for k, v in stats.items()
                             if k.startswith("trace_duty.")}
        return {**out, "messages_per_source": sources, "nvml_rows": nvml}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # Ctrl-C: what `fleetscope agent` handles
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---- the workload ------------------------------------------------------------------------------

class Progress:
    """Rank 0's progress lines (t_monotonic, steps), read from the job's stdout on a thread."""

    def __init__(self, stream):
        self.points: list[tuple[float, int]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            if line.startswith('{"progress_steps"'):
                d = json.loads(line)
                with self.lock:
                    self.points.append((d["t_monotonic"], d["progress_steps"]))

    def copy(self) -> list[tuple[float, int]]:
        with self.lock:
            return list(self.points)


def start_job(args, work: Path):
    if not os.path.exists(DEBIAN_PYTHON):
        raise SystemExit(f"{DEBIAN_PYTHON} (Debian's python3.11, with USDT probes) is needed for this bench")
    wl_args = ["--duration-s", "86400", "--progress-s", "1"]  # stopped by us at the end
    if args.sleep_ms is not None:
        wl_args += ["--sleep-ms", str(args.sleep_ms)]
    job = launch(args.ranks, wl_args, python=DEBIAN_PYTHON, site_packages=venv_site_packages(),
                 run_id=f"ddpov-{uuid.uuid4().hex[:6]}", log_path=work / "workload.log")
    pids = job.rank_pids(timeout_s=120)
    progress = Progress(job.proc.stdout)
    deadline = time.monotonic() + 120
    while len(progress.copy()) < 3:  # training, not importing
        if job.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the job is not training; see {job.log_path}")
        time.sleep(0.5)
    return job, pids, progress


def other_trace_targets(pids: dict[int, int], launcher: int) -> list[int]:
    """Processes outside this job that trace_auto would trace too (they map a CUDA, NCCL or torch
    library): a neighbour's job here costs the full_tracing agent CPU and is not the bench's."""
    from fleetscope.producers.tracers.discovery import TargetSpec, all_pids
    ours, spec = {*pids.values(), launcher}, TargetSpec(auto=True)
    return [p for p in all_pids() if p not in ours and p != os.getpid() and spec.matches(p)]


# ---- one block -------------------------------------------------------------------------------

def run_block(args, setup: str, rnd: int, ctx: dict) -> dict:
    job, pids, progress, work = ctx["job"], ctx["pids"], ctx["progress"], ctx["work"]
    block = {"round": rnd, "setup": setup, "load1_at_start": round(os.getloadavg()[0], 2)}
    t_start = time.monotonic()
    agent = None
    try:
        if setup != "agent_off":
            agent = AgentProcess(setup, ctx["bootstrap"], f"ddpov-{ctx['run_id']}-r{rnd}-{setup}", work)
            deadline = t_start + args.ready_timeout_s
            ok, info = agent.ready(args.ranks)
            while not ok and time.monotonic() < deadline:
                time.sleep(1.0)
                ok, info = agent.ready(args.ranks)
            block.update(ready=ok, ready_s=round(time.monotonic() - t_start, 1), **info)
            if not ok:
                print(f"  WARNING: {setup} not ready after {args.ready_timeout_s:.0f} s ({info}); measuring anyway",
                      flush=True)
        time.sleep(args.warmup_s if agent else AGENT_OFF_SETTLE_S)
        block["other_trace_targets"] = {"start": other_trace_targets(pids, job.proc.pid)}
        probes = [ProcProbe("ranks", lambda: list(pids.values())), ProcProbe("torchrun", lambda: [job.proc.pid]),
                  ProcProbe("broker", lambda: [ctx["broker"].pid]), ProcProbe("bench", lambda: [os.getpid()])] \
            + ([agent.probe] if agent else [])
        cpu0, busy0, t0 = {p.name: p.cpu_s() for p in probes}, machine_busy(), time.monotonic()
        wall0 = time.time()
        if agent:
            agent_cpu_at_t0 = cpu0["agent"]
        while time.monotonic() < t0 + args.block_s:
            time.sleep(min(1.0, t0 + args.block_s - time.monotonic()))
            if job.proc.poll() is not None:
                raise RuntimeError(f"the job exited with {job.proc.returncode}; see {job.log_path}")
            if agent:
                agent.check()
        t1 = time.monotonic()
        cpu1, busy1 = {p.name: p.cpu_s() for p in probes}, machine_busy()
        block["other_trace_targets"]["end"] = other_trace_targets(pids, job.proc.pid)
        got = rate_between(progress.copy(), t0, t1)
        dt = t1 - t0
        cpu_pct = {n: round(100 * (cpu1[n] - cpu0[n]) / dt, 2) for n in cpu0}
        machine_pct = 100 * (busy1[0] - busy0[0]) / max(busy1[1] - busy0[1], 1) * (os.cpu_count() or 1)
        block.update(measured_s=round(dt, 1), measured_wall=[round(wall0, 1), round(wall0 + dt, 1)], cpu_pct=cpu_pct,
                     machine_cpu_pct=round(machine_pct, 1),
                     others_cpu_pct=round(machine_pct - sum(cpu_pct.values()), 1))
        if got:
            rate, steps, span = got
            # the ranks' CPU rate over the job's step rate (the two spans differ by under a second)
            block.update(steps_per_s=round(rate, 4), steps=steps, steps_span_s=round(span, 2),
                         rank_cpu_ms_per_step=round(1000 * (cpu1["ranks"] - cpu0["ranks"]) / dt / rate, 4))
        if agent:
            t_report = time.monotonic()
            block["agent"] = {"cpu_pct": cpu_pct["agent"], "start_cpu_s": round(agent_cpu_at_t0, 2),
                              "rss_mb": round(agent.probe.rss_mb(), 1), **agent.report()}
            block["report_s"] = round(time.monotonic() - t_report, 1)
    finally:
        if agent:
            t_stop = time.monotonic()
            agent.stop()
            block["agent_stop_s"] = round(time.monotonic() - t_stop, 1)
    return block


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Blocks run in rounds of agent_off, sampling_only, full_tracing (order "
                                        "rotating); ratios are paired within a round. Needs root for eBPF.")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the three setups (default: %(default)s)")
    ap.add_argument("--block-s", type=float, default=50.0, help="measured seconds per block (default: %(default)s)")
    ap.add_argument("--warmup-s", type=float, default=10.0,
                    help="seconds dropped at the start of an agent block, after the agent is ready (default: "
                         "%(default)s; one governor period); agent_off blocks drop 2 s")
    ap.add_argument("--ranks", type=int, default=2, help="DDP ranks (default: %(default)s)")
    ap.add_argument("--sleep-ms", type=float, default=None, help="the workload's per-step sleep (default: its own, 20)")
    ap.add_argument("--ready-timeout-s", type=float, default=240.0,
                    help="longest wait for the agent's tracers to attach (default: %(default)s)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/ddp_overhead.json"))
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.block_s < 5 or not 1 <= args.ranks <= 8:
        ap.error("need --rounds >= 1, --block-s >= 5, --ranks 1..8")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("note: not root, so the full_tracing agent cannot load eBPF programs and only samples", flush=True)
    work = Path(tempfile.mkdtemp(prefix="fleetscope-ddpov-"))
    code0, load_start, wall_start = code_state(), os.getloadavg(), time.time()
    broker = job = None
    blocks: list[dict] = []
    try:
        broker = EmbeddedBroker(0, log_path=work / "broker.log").start()
        job, pids, progress = start_job(args, work)
        print(f"job {job.run_id}: ranks {pids}; broker {broker.bootstrap}; logs in {work}", flush=True)
        ctx = {"job": job, "pids": pids, "progress": progress, "work": work, "broker": broker,
               "bootstrap": broker.bootstrap, "run_id": uuid.uuid4().hex[:6]}
        for rnd in range(args.rounds):
            for setup in rotated(SETUPS, rnd):
                b = run_block(args, setup, rnd, ctx)
                blocks.append(b)
                print(f"round {rnd} {setup}: {b.get('steps_per_s')} steps/s, rank CPU "
                      f"{b.get('rank_cpu_ms_per_step')} ms/step, agent {b.get('agent', {}).get('cpu_pct')}% CPU, "
                      f"others {b.get('others_cpu_pct')}%, load {b['load1_at_start']}", flush=True)
        load_end = os.getloadavg()
    finally:
        if job is not None:
            job.stop()
            shutil.rmtree(job.result_dir, ignore_errors=True)  # stopped, not waited for: launch leaves it
        if broker is not None:
            broker.stop()
    code1 = code_state()
    setups = summarise(blocks)
    full = setups.get("full_tracing", {})
    nvml = next((b["agent"]["nvml_rows"] for b in blocks if b.get("agent")), None)
    result = {
        "what": f"real PyTorch DDP training on the CPU (benchmarks/workloads/ddp_train.py, gloo, {args.ranks} ranks "
                "under torchrun, Debian python3.11 + the venv's torch) with no agent, a sampling-only agent, and the "
                "agent with its default tracing; embedded broker (tansu) receiving the batches",
        "goal": f"full_tracing slows the job's steps/s by at most {GOAL_SLOWDOWN_PCT:g}%",
        "meets_goal": full.get("meets_goal"),
        "setups": setups,
        "settings": {"rounds": args.rounds, "block_s": args.block_s, "warmup_s": args.warmup_s, "ranks": args.ranks,
                     "workload_sleep_ms": args.sleep_ms if args.sleep_ms is not None else "default (20)",
                     "agent": "python -m fleetscope agent, config defaults except FLEETSCOPE_TRACE='' in "
                              "sampling_only; sample_interval_s 1, proc_interval_s 1, trace_budget 0.01, "
                              "trace_duty_period_s 10",
                     "euid": os.geteuid()},
        "nvml": {"rows_published": nvml,
                 "note": "no GPU and no NVML library here: the sampler published this status and then nothing; "
                         "the NVML sampling cost of a GPU node is not in these numbers"},
        "blocks": blocks,
        "cpu_pct_note": "100 = one core; from /proc/<pid>/stat over the measured part of each block; others = the "
                        "machine's busy CPU minus the ranks, torchrun, broker, this bench and the agent",
        "host": {"cpus": os.cpu_count(), "kernel": os.uname().release, "loadavg_start": [round(x, 2) for x in load_start],
                 "loadavg_end": [round(x, 2) for x in load_end], "clk_tck": CLK_TCK,
                 "note": "shared machine; other engineers' work may run at the same time"},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall_start)),
        "duration_s": round(time.time() - wall_start, 1),
        "code": code0, "code_changed_during_run": code0 != code1,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("meets_goal", "setups", "host")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
