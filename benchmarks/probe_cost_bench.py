"""Per-call cost of tracing cudaLaunchKernel, and events lost at 200,000 calls (issue 3).

One run, on the CUDA stand-in (tests/gpu_stub: this machine has no GPU), of
the workload's tight loop of 200,000 cudaLaunchKernel calls (an empty
function: what remains is the probes' cost), measured five ways:

  untraced       no probes;
  floor          an empty uprobe+uretprobe pair (the least any entry/return tracer pays);
  full           CudaTracer as the agent runs it: all 18 probe pairs attached (as uprobe_multi links
                 whose entry and return programs dispatch on the API cookie), the
                 launch paired per thread, aggregated in BPF maps (stats,
                 latency histogram, per-kernel counts), read once per 100 ms sample;
  ringbuf        CudaTracer(detail=True): the same plus one ring-buffer record per
                 call, drained in bulk every 100 ms;
  printk         the eACGM-style transport: bpf_trace_printk text lines at entry
                 and return, read from trace_pipe by a Python thread.

Cost per call = the workload thread's own CPU time per call
(CLOCK_THREAD_CPUTIME_ID around its loop): uprobe handling runs in that
thread's context and counts, while time it spends preempted by the other
users of this shared 2-core machine does not. Wall time per call is reported
beside it. Each setup runs ROUNDS times, interleaved, because this
machine is shared (2 cores, several users): the median is the headline and
the minimum (the least disturbed round) is reported beside it. Ratios are against the floor; the goal
is full <= floor + 1.5 µs and nothing lost. Loss: for the tracers, calls the
maps counted vs calls made, plus their lost_events counter; for printk, lines
read vs lines written (2 per call). Writes results/probe_cost.json.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from fleetscope.eval.gpu_stub.build import Workload, build  # noqa: E402
from fleetscope.producers.tracers.cuda import CudaTracer  # noqa: E402
from fleetscope.producers.tracers.discovery import find_library  # noqa: E402

CALLS = 200_000
ROUNDS = 5
SAMPLE_S = 0.1
EMPTY_PAIR = b"int on_entry(void *ctx) { return 0; }\nint on_return(void *ctx) { return 0; }\n"
PRINTK = b"""
#include <uapi/linux/ptrace.h>
int on_entry(struct pt_regs *ctx) { bpf_trace_printk("fsbench E %lx\\n", PT_REGS_PARM1(ctx)); return 0; }
int on_return(struct pt_regs *ctx) { bpf_trace_printk("fsbench R %d\\n", (int)PT_REGS_RC(ctx)); return 0; }
"""
TRACE_PIPE = next((p for p in ("/sys/kernel/tracing/trace_pipe", "/sys/kernel/debug/tracing/trace_pipe")
                   if os.path.exists(p)), None)


def start(bindir: Path) -> Workload:
    w = Workload(bindir, "launch", CALLS, 0)
    w.loaded()
    return w


def cost(w: Workload) -> dict:
    _, wall, cpu = w.finish()
    return {"ns_per_call": cpu, "wall_ns_per_call": wall}


def untraced(bindir):
    w = start(bindir)
    w.go()
    return cost(w)


def raw_pair(bindir, text: bytes):
    from bcc import BPF
    w = start(bindir)
    lib = find_library(w.pid, r"/libcudart\.so").encode()
    b = BPF(text=text)
    try:
        b.attach_uprobe(name=lib, sym=b"cudaLaunchKernel", fn_name=b"on_entry", pid=w.pid)
        b.attach_uretprobe(name=lib, sym=b"cudaLaunchKernel", fn_name=b"on_return", pid=w.pid)
        w.go()
        return cost(w)
    finally:
        b.cleanup()


class PipeReader(threading.Thread):
    """Counts our lines on trace_pipe, as an eACGM-style collector would read them."""

    def __init__(self):
        super().__init__(daemon=True)
        self.lines = 0
        self.stop = threading.Event()
        self.f = open(TRACE_PIPE, "rb", buffering=0)
        os.set_blocking(self.f.fileno(), False)

    def run(self):
        buf = b""
        while not self.stop.is_set():
            try:
                chunk = self.f.read(1 << 16)
            except BlockingIOError:
                chunk = None
            if not chunk:
                time.sleep(0.001)
                continue
            buf += chunk
            *done, buf = buf.split(b"\n")
            self.lines += sum(1 for line in done if b"fsbench" in line)


def printk(bindir):
    reader = PipeReader()
    while True:  # drain what earlier runs left
        try:
            if not reader.f.read(1 << 16):
                break
        except BlockingIOError:
            break
    reader.start()
    try:
        res = raw_pair(bindir, PRINTK)
        time.sleep(1.0)  # let the reader catch up with what the kernel still holds
    finally:
        reader.stop.set()
        reader.join()
        reader.f.close()
    return {**res, "lines_read": reader.lines, "lines_written": 2 * CALLS,
            "lost_frac": round(1 - reader.lines / (2 * CALLS), 4)}


def full(bindir, detail=False):
    tracer = CudaTracer("bench", detail=detail)
    try:
        w = start(bindir)
        assert tracer.add_pid(w.pid)
        tracer.sample()
        counted, records, lost = 0, 0, 0
        stop = threading.Event()

        def sampler():
            nonlocal counted, records, lost
            while True:
                last = stop.wait(SAMPLE_S)
                batch = tracer.sample()
                m, d, v = (batch.columns[c] for c in ("metric", "device", "value"))
                m, d = m.to_numpy(), d.to_numpy()
                for i in range(batch.count):
                    if m[i] == "cuda.calls" and d[i] == "cudaLaunchKernel":
                        counted += int(v[i])
                    elif m[i] == "cuda.lost_events":
                        lost += int(v[i])
                records += len(tracer.records)
                if last:
                    return

        t = threading.Thread(target=sampler)
        t.start()
        w.go()
        res = cost(w)
        stop.set()
        t.join()
    finally:
        tracer.close()
    out = {**res, "calls_counted": counted, "lost_events": lost,
           "lost_frac": round(1 - counted / CALLS, 6)}
    if detail:
        out["records_read"] = records
        out["lost_frac"] = round(1 - min(counted, records) / CALLS, 6)
    return out


def main():
    if os.geteuid() != 0:
        sys.exit("probe_cost_bench loads BPF programs: run it as root")
    bindir = build(Path(tempfile.mkdtemp(prefix="probe_cost_")))
    setups = {"untraced": untraced, "floor": lambda b: raw_pair(b, EMPTY_PAIR), "full": full,
              "ringbuf": lambda b: full(b, detail=True), "printk": printk}
    runs: dict[str, list[dict]] = {k: [] for k in setups}
    for r in range(ROUNDS):
        for name, fn in setups.items():
            runs[name].append(fn(bindir))
            print(f"round {r} {name}: {runs[name][-1]}", flush=True)
    result = {}
    for name, rs in runs.items():
        med = statistics.median(x["ns_per_call"] for x in rs)
        keep = min(rs, key=lambda x: abs(x["ns_per_call"] - med))
        result[name] = {**keep, "us_per_call": round(med / 1000, 3),
                        "us_per_call_min": round(min(x["ns_per_call"] for x in rs) / 1000, 3),
                        "wall_us_per_call": round(statistics.median(x["wall_ns_per_call"] for x in rs) / 1000, 3),
                        "us_per_call_rounds": [round(x["ns_per_call"] / 1000, 3) for x in rs]}
    floor = result["floor"]["us_per_call"]
    for name, res in result.items():
        res["ratio_to_floor"] = round(res["us_per_call"] / floor, 3)
        res["over_floor_us"] = round(res["us_per_call"] - floor, 3)
        res["over_floor_us_min"] = round(res["us_per_call_min"] - result["floor"]["us_per_call_min"], 3)
    out = {"calls": CALLS, "rounds": ROUNDS, "sample_interval_s": SAMPLE_S, "machine": os.uname().release,
           "cpus": os.cpu_count(), "setups": result,
           "goal": "full <= floor + 1.5 us per call, no loss at 200,000 calls",
           "goal_met": result["full"]["over_floor_us"] <= 1.5 and result["full"]["lost_frac"] == 0,
           "achieved_call_rate_full_per_s": round(1e6 / result["full"]["us_per_call"])}
    path = ROOT / "benchmarks/results/probe_cost.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
