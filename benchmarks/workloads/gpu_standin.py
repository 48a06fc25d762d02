"""Workload (b): a GPU-job stand-in. Design of its knobs and per-step call plan; not yet driving the stubs.

There is no GPU here. The C stand-ins for libcudart and libnccl (tests/gpu_stub/, another
engineer's) export the real symbols, so the CUDA and NCCL uprobes fire on them. This
module decides *what* a training step calls and *how long* each call should take, for a
data-parallel job: copy the batch host-to-device, launch forward/backward kernels, all-reduce
the gradients, synchronize, sleep. `plan_step()` is pure and tested through `--plan`.

Per step (the defaults give about 9 steps/s):
  cudaMemcpy HtoD   batch_mb / h2d_gbps          (+ memcpy_stall extra_ms on the faulty rank)
  cudaLaunchKernel  x kernels, each kernel_us of GPU time (asynchronous: launch cost only)
  cudaMalloc        bytes_per_step, never freed  (gpu_memory_leak on the faulty rank)
  ncclAllReduce     grad_mb: latency_us + bytes / link_gbps  (link slows under link_delay)
  cudaStreamSynchronize  waits for the queued kernels: kernels * kernel_us
  host sleep        step_sleep_ms (input pipeline, optimizer on the host)

Faults come from the same per-rank control file as ddp_train.py
(FLEETSCOPE_WORKLOAD_CONTROL_DIR/rank<R>.json, written by benchmarks/eval/faults.py):
    {"memcpy_stall": {"extra_ms": 25}, "gpu_memory_leak": {"bytes_per_step": 16777216}}

TODO(integration with tests/gpu_stub/): execute the plan. The stubs take their per-call
duration from GPU_STUB_DELAY_US, read once per function at its first call, so a fault
that starts mid-run cannot change a call's duration today. Options for the stub owner:
(1) a per-call duration argument or a runtime setter exported by the stubs
(e.g. `gpu_stub_set_delay_us(const char *fn, long us)`), which `run_plan` would call through
ctypes before each call; (2) re-read GPU_STUB_DELAY_US from a control file when its mtime
changes. For `network_degradation`, ncclAllReduce's duration should come from a real TCP
exchange between the stand-in ranks (ring neighbours over sockets the runner can point at a
benchmarks/eval/relay.DelayRelay), done in the stand-in process around the stub call.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field

from benchmarks.eval.faults import KNOB_KINDS


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
    """The calls of one step, in order, for a rank whose control file holds `knobs`."""
    knobs = knobs or {}
    unknown = set(knobs) - {k for k, _, _ in KNOB_KINDS.values()} - {"link_delay"}
    if unknown:
        raise ValueError(f"unknown stand-in knob(s) {sorted(unknown)}")
    batch_bytes = int(cfg.batch_mb * 1e6)
    memcpy_us = batch_bytes * 8 / (cfg.h2d_gbps * 1e9) * 1e6
    memcpy_us += 1000.0 * knobs.get("memcpy_stall", {}).get("extra_ms", 0.0)
    calls = [Call("cudaMemcpy", memcpy_us, {"bytes": batch_bytes, "kind": "HtoD"})]
    calls += [Call("cudaLaunchKernel", cfg.kernel_launch_us, {"gpu_us": cfg.kernel_us})] * cfg.kernels
    leak = int(knobs.get("gpu_memory_leak", {}).get("bytes_per_step", 0))
    if leak:
        calls.append(Call("cudaMalloc", 20.0, {"bytes": leak, "free": False}))
    link = knobs.get("link_delay", {})
    link_gbps = cfg.link_gbps
    if link.get("bandwidth_mbps"):
        link_gbps = min(link_gbps, link["bandwidth_mbps"] / 1000.0)
    calls.append(Call("ncclAllReduce", _ring_allreduce_us(cfg, world, link_gbps, 1000.0 * link.get("delay_ms", 0.0)),
                      {"bytes": int(cfg.grad_mb * 1e6), "op": "sum", "dtype": "float32"}))
    gpu_us = cfg.kernels * cfg.kernel_us
    calls.append(Call("cudaStreamSynchronize", max(0.0, gpu_us - cfg.kernels * cfg.kernel_launch_us)))
    calls.append(Call("sleep", cfg.step_sleep_ms * 1000.0))
    return calls


def step_time_us(calls: list[Call]) -> float:
    return sum(c.duration_us for c in calls)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f, default in asdict(StandinConfig()).items():
        p.add_argument(f"--{f.replace('_', '-')}", type=type(default), default=default)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--knobs", default="{}", help='a control-file body, e.g. \'{"memcpy_stall": {"extra_ms": 25}}\'')
    p.add_argument("--plan", action="store_true", help="print one step's call plan as JSON and exit")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = StandinConfig(**{f: getattr(args, f) for f in asdict(StandinConfig())})
    calls = plan_step(cfg, args.world, json.loads(args.knobs))
    if args.plan:
        print(json.dumps({"step_time_ms": round(step_time_us(calls) / 1000, 3),
                          "calls": [asdict(c) for c in calls]}))
        return 0
    print("gpu_standin: running the plan against tests/gpu_stub is not wired yet (see the TODO in this "
          "module's docstring); use --plan to see the per-step schedule", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
