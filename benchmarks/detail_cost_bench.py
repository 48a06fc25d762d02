"""Per-call cost of the torch tracer's detail mode (one ring-buffer record per op call) on a real PyTorch process.

The workload is a separate Python process (Debian's python3 with the venv's
torch on PYTHONPATH, as torch_overhead_bench.py / toggle_cost_bench.py run
theirs; 1 thread): it imports torch, builds two 4x4 float32 tensors, warms
up, says "ready", waits for "go" on stdin, then runs CALLS calls of
torch.mm(a, b) in a tight loop and reports the loop's own CPU time
(time.process_time_ns: the uprobes run in its context and count) and wall
time. torch.mm is probed as op "mm" (torch::autograd::THPVariable_mm, in
DEFAULT_OPS): each call is one entry and one return probe hit. Setups, in
interleaved rounds (the machine is shared: drift and neighbours' load hit all
alike):

  untraced     no tracer attached;
  detail_off   TorchTracer(detail=False), the default agent build, all DEFAULT_OPS attached;
  gate_closed  TorchTracer(detail=True, detail_always=False): built with -DDETAIL, the detail gate
               closed, as an agent with trace_capture_s > 0 runs between captures (one array
               lookup more per return);
  gate_open    TorchTracer(detail=True, detail_always=True): one ring-buffer record reserved and
               submitted per call, the ring drained by the tracer's sample() every 0.1 s from a
               thread of this process (records read, and lost ones from torch.lost_events).

The tracers are built once (compiling the BPF program takes seconds of CPU),
attached once to a workload that never runs (the first attach reads
libtorch's symbols), then attached to each run's fresh workload before "go"
and detached after. Each round starts with the next setup in turn, so no
setup always runs first.

Cost per call = the loop's CPU ns / CALLS; the median over rounds is the
headline. over_untraced_us and over_detail_off_us are differences of those
medians. For gate_open, records_read, calls (made), lost and calls_counted
(the tracer's torch.ops rows for "mm") are summed over rounds, and the CPU
this process's drain thread spent is reported beside it (drain_us_per_call:
the agent's side, not the workload's).

Writes benchmarks/results/detail_cost.json. Run as root:
  .venv/bin/python benchmarks/detail_cost_bench.py [--rounds 5 --calls 500000 --out PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from fleetscope.producers.tracers.torch_ops import DEFAULT_OPS, TorchTracer  # noqa: E402

OP = "mm"  # the probed op name of torch.mm (THPVariable_mm)
SAMPLE_S = 0.1
WARMUP_CALLS = 2000
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
SETUPS = ("untraced", "detail_off", "gate_closed", "gate_open")
# The workload: argv[1] calls of torch.mm on 4x4 tensors, timed by the process itself.
WORKLOAD = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
calls, warmup = int(sys.argv[1]), int(sys.argv[2])
a, b = torch.randn(4, 4), torch.randn(4, 4)
mm = torch.mm
for _ in range(warmup):
    mm(a, b)
print("ready", torch.__version__, flush=True)
if sys.stdin.readline().strip() != "go":
    sys.exit(0)
w0, c0 = time.perf_counter_ns(), time.process_time_ns()
for _ in range(calls):
    mm(a, b)
c1, w1 = time.process_time_ns(), time.perf_counter_ns()
print(json.dumps({"cpu_ns": c1 - c0, "wall_ns": w1 - w0}), flush=True)
sys.stdin.readline()  # stay (attached) until the bench is done with us, or its end closes our stdin
"""


class MmLoop:
    """One workload process, stopped before its loop until go()."""

    def __init__(self, calls: int):
        env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
        self.calls = calls
        self.proc = subprocess.Popen([PYTHON, "-c", WORKLOAD, str(calls), str(WARMUP_CALLS)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        ready = self.proc.stdout.readline().split()
        if not ready or ready[0] != "ready":
            self.close()
            raise RuntimeError(f"workload pid {self.pid} did not start (exit status {self.proc.poll()})")
        self.torch_version = ready[1]

    def go(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self) -> dict:
        """The loop's {"ns_per_call", "wall_ns_per_call"}, once it is done."""
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"workload pid {self.pid} ended without a result (exit status {self.proc.poll()})")
        res = json.loads(line)
        return {"ns_per_call": res["cpu_ns"] / self.calls, "wall_ns_per_call": res["wall_ns"] / self.calls}

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # its last readline ends: it exits
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.proc.wait()


def attach(tracer: TorchTracer, pid: int):
    if not tracer.add_pid(pid):
        raise RuntimeError(f"TorchTracer cannot trace pid {pid}: {tracer.unavailable.get(pid)}")
    probes = tracer.pids[pid].get("ops")
    if probes is None or tracer.op_names.index(OP) not in probes.cookies:
        raise RuntimeError(f"op {OP!r} is not probed in pid {pid}: {tracer.family_unavailable.get(pid)}")


class Drain(threading.Thread):
    """Calls tracer.sample() every SAMPLE_S until stopped (then once more): records read, lost, calls counted."""

    def __init__(self, tracer: TorchTracer, pid: int):
        super().__init__(daemon=True)
        self.tracer, self.pid = tracer, pid
        self.stop = threading.Event()
        self.records = self.lost = self.counted = self.cpu_ns = 0
        self.error: BaseException | None = None

    def run(self):
        try:
            while True:
                last = self.stop.wait(SAMPLE_S)
                t0 = time.thread_time_ns()
                self.count(self.tracer.sample())
                self.cpu_ns += time.thread_time_ns() - t0
                if last:
                    return
        except BaseException as e:  # re-raised by the main thread
            self.error = e

    def count(self, batch):
        self.records += len(self.tracer.records)
        if batch is None:
            return
        m, d, p, v = (batch.columns[c] for c in ("metric", "device", "pid", "value"))
        m, d = m.to_numpy(), d.to_numpy()
        for i in range(batch.count):
            if p[i] != self.pid:
                continue
            if m[i] == "torch.lost_events":
                self.lost += int(v[i])
            elif m[i] == "torch.ops" and d[i] == OP:
                self.counted += int(v[i])

    def finish(self) -> dict:
        self.stop.set()
        self.join()
        if self.error is not None:
            raise self.error
        return {"records_read": self.records, "lost": self.lost, "calls_counted": self.counted,
                "drain_cpu_ns": self.cpu_ns}


def run_once(calls: int, tracer: TorchTracer | None, drain: bool) -> dict:
    w = MmLoop(calls)
    drainer = None
    try:
        if tracer is not None:
            attach(tracer, w.pid)
        if drain:
            tracer.sample()  # the counters' baseline, and whatever an earlier run left in the ring
            drainer = Drain(tracer, w.pid)
            drainer.start()
        w.go()
        res = {**w.finish(), "torch": w.torch_version}
        if drainer is not None:
            res.update(drainer.finish(), calls=calls)
        return res
    finally:
        if drainer is not None and drainer.is_alive():
            drainer.stop.set()
            drainer.join()
        if tracer is not None:
            tracer.remove_pid(w.pid)
        w.close()


def build_tracers(held: list) -> dict:
    """The traced setups' tracers, each appended to `held` as soon as it exists (closed by the caller)."""
    specs = {"detail_off": {"detail": False}, "gate_closed": {"detail": True, "detail_always": False},
             "gate_open": {"detail": True, "detail_always": True}}
    tracers = {}
    for name, kw in specs.items():
        tracers[name] = TorchTracer("bench", **kw)
        held.append(tracers[name])
    if tracers["gate_closed"].detail_until != 0:
        raise RuntimeError("gate_closed: the detail gate is open")
    return tracers


def warm_up(tracers: dict):
    """Attach every tracer once to a workload that never runs its loop: the first attach reads libtorch's symbols
    (nm, c++filt, disassembly; cached for the rest of the run), which no measured run should follow."""
    w = MmLoop(1)
    try:
        for tracer in tracers.values():
            attach(tracer, w.pid)
            tracer.remove_pid(w.pid)
    finally:
        w.close()


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Per setup: medians over rounds; for gate_open, records read, calls made, lost and counted, summed over rounds."""
    result = {}
    for name, rs in runs.items():
        res = {"us_per_call": round(statistics.median(r["ns_per_call"] for r in rs) / 1000, 3),
               "us_per_call_min": round(min(r["ns_per_call"] for r in rs) / 1000, 3),
               "wall_us_per_call": round(statistics.median(r["wall_ns_per_call"] for r in rs) / 1000, 3),
               "us_per_call_rounds": [round(r["ns_per_call"] / 1000, 3) for r in rs]}
        if name == "gate_open":
            res.update({k: sum(r[k] for r in rs) for k in ("records_read", "calls", "lost", "calls_counted")})
            res["drain_us_per_call"] = round(sum(r["drain_cpu_ns"] for r in rs) / res["calls"] / 1000, 3)
        result[name] = res
    for name, res in result.items():
        res["over_untraced_us"] = round(res["us_per_call"] - result["untraced"]["us_per_call"], 3)
        if name != "untraced":
            res["over_detail_off_us"] = round(res["us_per_call"] - result["detail_off"]["us_per_call"], 3)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=500_000, help="torch.mm calls per setup run")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/detail_cost.json"))
    args = ap.parse_args()
    if args.rounds < 1 or args.calls < 1:
        sys.exit("--rounds and --calls must be at least 1")
    if os.geteuid() != 0:
        sys.exit("detail_cost_bench loads BPF programs and attaches uprobes: run it as root")
    if OP not in DEFAULT_OPS:
        sys.exit(f"op {OP!r} is not in the torch tracer's DEFAULT_OPS any more: pick another op")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # cleanup below runs on SIGTERM too
    held: list[TorchTracer] = []
    runs: dict[str, list[dict]] = {name: [] for name in SETUPS}
    try:
        tracers = build_tracers(held)
        warm_up(tracers)
        for r in range(args.rounds):
            for name in SETUPS[r % len(SETUPS):] + SETUPS[:r % len(SETUPS)]:  # each round starts one later
                res = run_once(args.calls, tracers.get(name), drain=name == "gate_open")
                runs[name].append(res)
                extra = {k: res[k] for k in ("records_read", "lost", "calls_counted") if k in res}
                print(f"round {r} {name}: {res['ns_per_call'] / 1000:.3f} us/call CPU, "
                      f"{res['wall_ns_per_call'] / 1000:.3f} us/call wall {extra or ''}", flush=True)
    finally:
        for t in held:
            t.close()
    out = {"what": "CPU time per torch.mm call (4x4, 1 thread) of a real PyTorch process, untraced and under "
                   "TorchTracer without detail mode, with it but the gate closed, and with a ring-buffer record "
                   "per call drained every 0.1 s",
           "op": f"torch.mm on 4x4 float32 tensors, probed as op {OP!r} (THPVariable_mm)",
           "calls": args.calls, "rounds": args.rounds, "sample_interval_s": SAMPLE_S,
           "cpus": os.cpu_count(), "kernel": os.uname().release, "loadavg_end": os.getloadavg(),
           "python": PYTHON, "torch": runs["untraced"][0]["torch"] if runs["untraced"] else None,
           "setups": summarize(runs)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
