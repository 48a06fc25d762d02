"""What attaching and detaching a probe family costs the traced process (issue 3, overhead governor).

The workload is the real PyTorch CPU training loop (tests/workloads/torch_train.py
under Debian's python3, 1 thread), which prints its steps/s every second.
Toggled, each time "attach, then detach at once" (~0 on-time), every P seconds:

  multi_<P>s         TorchTracer's "ops" family as the governor drives it (the
                     default op list: entry+return probes on every wrapper) as
                     two uprobe_multi links (set_family_enabled on, off);
  small_multi_<P>s   a few wrappers of ops the loop never calls (COLD_OPS: no
                     hit can land), as uprobe_multi links;
  small_single_<P>s  the same wrappers as single-probe perf events (one fd per
                     probe, closed concurrently), the way the CUDA/NCCL/Python
                     tracers attached before; the full op list as single probes
                     takes >10 s per toggle here, so it is not cycled.

Each toggled phase is followed by a never-toggled baseline phase of the same
length (paired, interleaved rounds: the machine is shared, 2 vCPUs, other
users). The headline is the loop's main-thread CPU time per step (from
/proc/<pid>/schedstat, ns), least disturbed by neighbours' load; wall time
per step is reported beside it. Per setup:

  cost_ms_per_toggle = (cpu per step toggled - cpu per step baseline) x steps / toggles
                       - the probe hits that landed in the brief on-windows x cost per hit

(the cost per hit comes from an all-on phase each round), plus the traced
process's minor page faults per toggle (breakpoints are written into private
copies of its text pages and removed again) and the agent's wall time per
toggle.

Part "standin" bounds the cost on a quieter signal: two CUDA stand-in
workloads (tests/gpu_stub: no GPU here) run a tight loop of untraced
cudaLaunchKernel calls at the same time; in one of them CudaTracer's "sync"
family (same library, same text pages, never called by the loop: no hits)
is attached+detached back to back, as uprobe_multi links or as single
perf-event uprobes; the other is the control. cost per toggle = (toggled
thread CPU - control thread CPU) / toggles; mode "none" toggles nothing and
shows the noise floor.

Writes benchmarks/results/toggle_cost.json (a part run alone keeps the other's results). Run as root:
  .venv/bin/python benchmarks/toggle_cost_bench.py [--rounds 8 --long-rounds 2 --phase-s 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from fleetscope.resources import package_dir  # noqa: E402
from fleetscope.producers.tracers.torch_ops import TorchTracer  # noqa: E402
from fleetscope.producers.tracers.uprobes import attach_uprobe_fd, close_all, symbol_offset  # noqa: E402

PERIODS = (0.5, 2.0)           # cycled in every round
LONG_PERIODS = (10.0, 30.0)    # one toggle per phase: in --long-rounds rounds only
SMALL_PERIOD = 2.0
COLD_OPS = frozenset({"conv3d", "conv_transpose2d", "embedding", "group_norm"})


def thread_cpu_ns(pid: int) -> int:
    with open(f"/proc/{pid}/schedstat") as f:  # the main thread: run time (ns), wait time, slices
        return int(f.read().split()[0])


class Loop:
    """The training loop; each printed second is recorded as (phase, steps, wall s, main-thread CPU ns)."""

    def __init__(self, go: str):
        env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
        self.proc = subprocess.Popen(["/usr/bin/python3", str(package_dir("fleetscope.eval.workloads") / "torch_train.py"), go, "0"],
                                     env=env, stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        self.phase = "warmup"
        self.seconds: list[tuple[str, float, float, int]] = []
        self._mark = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            now, cpu = time.monotonic(), thread_cpu_ns(self.pid)
            if self._mark is not None:
                wall = now - self._mark[0]
                self.seconds.append((self.phase, float(line) * wall, wall, cpu - self._mark[1]))
            self._mark = (now, cpu)

    def enter(self, phase: str):
        self.phase = "switch"  # the second that straddles the change is not counted
        time.sleep(1.2)
        self.phase = phase

    def totals(self, phase: str) -> dict:
        rows = [s for s in self.seconds if s[0] == phase]
        steps, wall, cpu = (sum(r[i] for r in rows) for i in (1, 2, 3))
        return {"steps": steps, "wall_s": wall, "cpu_s": cpu / 1e9, "seconds": len(rows)}


class SingleProbes:
    """The tracer's op probes as single perf-event uprobes (entry and return per wrapper)."""

    def __init__(self, tracer: TorchTracer, pid: int):
        from bcc import BPF
        self.pid = pid
        ops = tracer.pids[pid]["ops"]  # a FamilyProbes
        self.lib, self.offsets = ops.lib, ops.entries
        self.probes = 2 * len(self.offsets)
        # its own copy of the programs: a program loaded for uprobe_multi links cannot go on a perf event
        self.bpf = BPF(src_file=str(package_dir("fleetscope.bpf") / "torch.bpf.c").encode(), cflags=[f"-I{package_dir('fleetscope.bpf')}", "-Wno-everything"])
        self.prog = {ret: self.bpf.load_func(fn, BPF.KPROBE).fd for ret, fn in ((False, b"op_entry"), (True, b"op_return"))}

    def hits(self) -> int:
        h = self.bpf[b"hits"]
        return int(sum(h.getvalue(h.Key(0))))

    def toggle(self):
        fds = [attach_uprobe_fd(self.prog[ret], self.lib, off, self.pid, retprobe=ret)
               for off in self.offsets for ret in (False, True)]
        close_all(fds)


def run_phase(loop, name, seconds, toggle=None, period=None):
    loop.enter(name)
    end = time.monotonic() + seconds
    toggles, busy = 0, 0.0
    next_t = time.monotonic()
    while time.monotonic() < end:
        if toggle is not None and time.monotonic() >= next_t:
            t0 = time.monotonic()
            toggle()
            busy += time.monotonic() - t0
            toggles += 1
            next_t = t0 + period
        time.sleep(max(0.0, min(next_t if toggle else end, end) - time.monotonic()))
    return toggles, busy


def minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return int(stat[stat.rindex(b")") + 2:].split()[7])  # minflt (field 10)


STANDIN_CALLS = 200_000_000
SYNC_APIS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def standin_part(rounds: int) -> dict:
    """Thread CPU per untraced cudaLaunchKernel call of a toggled process against a control process run
    at the same time (both see the same neighbours), for no toggles (the noise floor), multi and single."""
    from bcc import BPF
    from fleetscope.eval.gpu_stub.build import Workload, build
    from fleetscope.producers.tracers.cuda import CudaTracer
    from fleetscope.producers.tracers.discovery import find_library
    bindir = build(Path(tempfile.mkdtemp(prefix="toggle_cost_")))
    tracer = CudaTracer("bench")
    for fam in tracer.families():
        tracer.set_family_enabled(fam, False)
    empty = BPF(text=b"int on_entry(void *ctx) { return 0; }\n")
    prog = empty.load_func(b"on_entry", BPF.KPROBE).fd
    runs: dict[str, list] = {"none": [], "multi": [], "single": []}
    try:
        for _ in range(rounds):
            for mode in runs:
                w, control = Workload(bindir, "launch", STANDIN_CALLS, 0), Workload(bindir, "launch", STANDIN_CALLS, 0)
                w.loaded()
                control.loaded()
                lib = find_library(w.pid, r"/libcudart\.so")
                offsets = [symbol_offset(lib, s) for s in SYNC_APIS]
                if mode == "multi":
                    assert tracer.add_pid(w.pid)  # every family is off: nothing attached yet

                    def toggle():
                        tracer.set_family_enabled("sync", True)
                        tracer.set_family_enabled("sync", False)
                else:
                    def toggle():
                        close_all([attach_uprobe_fd(prog, lib, off, w.pid, retprobe=ret)
                                   for off in offsets for ret in (False, True)])
                stop, count, busy = threading.Event(), [0], [0.0]

                def cycler():
                    while not stop.wait(0.02):
                        t0 = time.monotonic()
                        try:
                            toggle()
                        except OSError:  # the workload finished meanwhile
                            return
                        busy[0] += time.monotonic() - t0
                        count[0] += 1
                th = threading.Thread(target=cycler) if mode != "none" else None
                control.go()
                w.go()
                if th:
                    th.start()
                _, wall, cpu = w.finish()
                if th:
                    stop.set()
                    th.join()
                _, _, cpu_c = control.finish()
                if mode == "multi":
                    tracer.remove_pid(w.pid)
                runs[mode].append({"cpu_ns_per_call": cpu, "control_cpu_ns_per_call": cpu_c, "toggles": count[0],
                                   "agent_ms_per_toggle": 1e3 * busy[0] / max(count[0], 1)})
                print(f"standin {mode}: {runs[mode][-1]}", flush=True)
    finally:
        tracer.close()
        empty.cleanup()
    out = {"what": f"thread CPU of {STANDIN_CALLS:,} untraced cudaLaunchKernel calls (stand-in) in a process whose "
                   "'sync' family (same library, no hits) is toggled back to back, against a control process run "
                   "at the same time; 'none' toggles nothing (the noise floor of the ratio)",
           "rounds": rounds, "probes_toggled": 2 * len(SYNC_APIS),
           "cpu_ns_per_call_resolution": 0.1, "resolution_ms_per_run": 0.1 * STANDIN_CALLS / 1e6}
    for mode, rs in runs.items():
        extra_ms = [(r["cpu_ns_per_call"] - r["control_cpu_ns_per_call"]) * STANDIN_CALLS / 1e6 for r in rs]
        out[mode] = {"toggles_per_run": statistics.median(r["toggles"] for r in rs),
                     "agent_ms_per_toggle": round(statistics.median(r["agent_ms_per_toggle"] for r in rs), 2),
                     "cpu_ratio_to_control_median": round(statistics.median(
                         r["control_cpu_ns_per_call"] / r["cpu_ns_per_call"] for r in rs), 4),
                     "extra_cpu_ms_per_run": [round(x, 1) for x in extra_ms]}
        if mode != "none":
            n = statistics.median(r["toggles"] for r in rs)
            out[mode]["cost_ms_per_toggle_cpu_median"] = round(statistics.median(extra_ms) / max(n, 1), 3)
    out["runs"] = runs
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=("torch", "standin", "all"), default="all")
    ap.add_argument("--standin-rounds", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--long-rounds", type=int, default=2)
    ap.add_argument("--phase-s", type=float, default=3.0, help="length of a phase (at least one period)")
    ap.add_argument("--periods", type=float, nargs="+", default=PERIODS)
    ap.add_argument("--long-periods", type=float, nargs="+", default=LONG_PERIODS)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/toggle_cost.json"))
    args = ap.parse_args()
    prior = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
    if args.part != "torch":
        prior["standin"] = standin_part(args.standin_rounds)
        Path(args.out).write_text(json.dumps(prior, indent=2) + "\n")
    if args.part == "standin":
        print(json.dumps({k: v for k, v in prior["standin"].items() if k != "runs"}, indent=2))
        return
    go = tempfile.mktemp(prefix="fleetscope-toggle-go-")
    loop = Loop(go)
    while not os.path.exists(go + ".ready"):
        time.sleep(0.05)
    open(go, "w").close()
    tracer, small, single, n_multi = TorchTracer("bench"), TorchTracer("bench", ops=COLD_OPS), None, None
    stats: dict[str, dict] = {}
    rounds: dict[str, list] = {}
    try:
        for t in (tracer, small):
            assert t.add_pid(loop.pid), t.unavailable
            t.set_family_enabled("ops", False)
        single = SingleProbes(small, loop.pid)
        n_multi = 2 * len(tracer.pids[loop.pid]["ops"].entries)

        def toggler(t):
            def toggle():
                t.set_family_enabled("ops", True)
                t.set_family_enabled("ops", False)
            return toggle

        short = {f"multi_{p:g}s": (toggler(tracer), p) for p in args.periods}
        short[f"small_multi_{SMALL_PERIOD:g}s"] = (toggler(small), SMALL_PERIOD)
        short[f"small_single_{SMALL_PERIOD:g}s"] = (single.toggle, SMALL_PERIOD)
        long = {f"multi_{p:g}s": (toggler(tracer), p) for p in args.long_periods}

        def hits():
            return tracer.hits()["ops"] + small.hits()["ops"] + single.hits()

        def phase(name, seconds, fn=None, period=None):
            h0, f0 = hits(), minor_faults(loop.pid)
            n, b = run_phase(loop, name, seconds, fn, period)
            st = stats.setdefault(name, {"toggles": 0, "busy": 0.0, "hits": 0, "minflt": 0})
            st["toggles"] += n
            st["busy"] += b
            st["hits"] += hits() - h0
            st["minflt"] += minor_faults(loop.pid) - f0

        for r in range(max(args.rounds, args.long_rounds)):
            plan = list(short.items()) if r < args.rounds else []
            if r < args.long_rounds:
                plan += list(long.items())
            for name, (fn, period) in plan:
                seconds = max(args.phase_s, period)
                before = loop.totals(name)
                phase(name, seconds, fn, period)
                after_t = loop.totals(name)
                b0 = loop.totals("baseline")
                phase("baseline", seconds)  # a baseline right after each toggled phase: paired ratios
                b1 = loop.totals("baseline")
                cpu_t = (after_t["cpu_s"] - before["cpu_s"]) / max(after_t["steps"] - before["steps"], 1)
                cpu_b = (b1["cpu_s"] - b0["cpu_s"]) / max(b1["steps"] - b0["steps"], 1)
                rounds.setdefault(name, []).append(cpu_b / cpu_t if cpu_t else float("nan"))
                print(f"round {r} {name}: cpu ratio {rounds[name][-1]:.4f} {stats[name]}", flush=True)
            tracer.set_family_enabled("ops", True)  # the cost of a hit, from an all-on phase each round
            phase("all_on", args.phase_s)
            tracer.set_family_enabled("ops", False)
    finally:
        for t in (tracer, small):
            t.close()
        if single is not None:
            single.bpf.cleanup()
        loop.proc.kill()
        loop.proc.wait()
        for f in (go, go + ".ready"):
            if os.path.exists(f):
                os.remove(f)
    names = [n for n in [*short, *long] if n in stats]
    tot = {name: loop.totals(name) for name in [*names, "baseline", "all_on"]}
    base = tot["baseline"]
    cpu_step0, wall_step0 = base["cpu_s"] / base["steps"], base["wall_s"] / base["steps"]
    on = tot["all_on"]
    hit_cost = max(on["cpu_s"] / on["steps"] - cpu_step0, 0.0) * on["steps"] / max(stats["all_on"]["hits"], 1)
    result = {"what": "cost to the real PyTorch CPU training loop's main thread of attaching+detaching a torch op "
                      "probe family (~0 on-time) every P s; each toggled phase is followed by a never-toggled "
                      "baseline phase of the same length",
              "rounds": args.rounds, "long_rounds": args.long_rounds, "phase_s": args.phase_s,
              "probes": {"multi": n_multi,
                         "small": single.probes if single else None},
              "cost_per_hit_us_cpu": round(hit_cost * 1e6, 2),
              "baseline": {"cpu_us_per_step": round(cpu_step0 * 1e6, 1), "wall_us_per_step": round(wall_step0 * 1e6, 1),
                           "steps_per_s": round(base["steps"] / base["wall_s"], 1),
                           "minflt_per_s": round(stats["baseline"]["minflt"] / base["wall_s"], 2)},
              "setups": {}}
    for name in names:
        t, st = tot[name], stats[name]
        n = max(st["toggles"], 1)
        cpu_step, wall_step = t["cpu_s"] / t["steps"], t["wall_s"] / t["steps"]
        hit_s = st["hits"] * hit_cost
        result["setups"][name] = {
            "toggles": st["toggles"], "hits_in_on_windows": st["hits"],
            "agent_ms_per_toggle": round(1e3 * st["busy"] / n, 2),
            "minor_faults_per_toggle": round((st["minflt"] - stats["baseline"]["minflt"] / base["wall_s"]
                                              * t["wall_s"]) / n, 2),
            "cpu_ratio_pooled": round(cpu_step0 / cpu_step, 4), "steps_per_s_ratio_pooled": round(wall_step0 / wall_step, 4),
            "cpu_ratio_paired_median": round(statistics.median(rounds[name]), 4),
            "cpu_ratio_paired": [round(x, 4) for x in rounds[name]],
            "cost_ms_per_toggle_cpu": round(1e3 * ((cpu_step - cpu_step0) * t["steps"] - hit_s) / n, 3),
            "cost_ms_per_toggle_cpu_paired": round(1e3 * ((1 / statistics.median(rounds[name]) - 1) * cpu_step0
                                                          * t["steps"] - hit_s) / n, 3),
            "hits_ms_per_toggle": round(1e3 * hit_s / n, 3),
            "measured_s": round(t["wall_s"], 1)}
    result["all_on_cpu_ratio"] = round(cpu_step0 / (on["cpu_s"] / on["steps"]), 4)
    result["host"] = {"cpus": os.cpu_count(), "kernel": os.uname().release, "loadavg": os.getloadavg(),
                      "note": "2 shared vCPUs; other engineers' work ran at the same time"}
    if "standin" in prior:
        result["standin"] = prior["standin"]
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
