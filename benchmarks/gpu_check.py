"""The NVML device check for a lent GPU machine (issue 4). Not run yet: this task had no device.

Samples the real GPU through NvmlSampler at 100 ms for ~60 s while a PyTorch
matmul loop runs in phases: idle, then two matrix sizes x two precisions.
Writes every sample and a per-phase summary (mean OFU, tensor activity, SM
clock, power, energy, decoded throttle flags) to $OUT (or ./gpu_check_out),
and checks that OFU rises with tensor work. It changes no GPU setting.

    python benchmarks/gpu_check.py            # about 70 s
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path


from fleetscope.producers.nvml.sampler import NvmlSampler  # noqa: E402

PHASES = [("idle", None, None), ("mm4096_fp32", 4096, "float32"), ("mm4096_bf16", 4096, "bfloat16"),
          ("mm8192_fp32", 8192, "float32"), ("mm8192_bf16", 8192, "bfloat16")]
PHASE_S = float(os.environ.get("GPU_CHECK_PHASE_S", "12"))


def rows_of(batch) -> list[dict]:
    cols = {k: (v.to_numpy() if hasattr(v, "to_numpy") else v) for k, v in batch.columns.items()}
    return [{k: (v[i].item() if hasattr(v[i], "item") else v[i]) for k, v in cols.items()} for i in range(batch.count)]


def sample_loop(sampler: NvmlSampler, out: list, phase: list, stop: threading.Event) -> None:
    next_at = time.monotonic()
    while not stop.is_set():
        batch = sampler.sample(time.time_ns())
        if batch is not None:
            for row in rows_of(batch):
                row["phase"] = phase[0]
                out.append(row)
        next_at += 0.1
        stop.wait(max(0.0, next_at - time.monotonic()))


def matmul_phase(size: int, dtype_name: str, seconds: float) -> float:
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 stays off the tensor cores: the contrast we want
    dtype = getattr(torch, dtype_name)
    a = torch.randn(size, size, device="cuda", dtype=dtype)
    b = torch.randn(size, size, device="cuda", dtype=dtype)
    n = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(10):
            a @ b
        torch.cuda.synchronize()
        n += 10
    return 2 * size ** 3 * n / seconds / 1e12  # TFLOP/s achieved


def summarize(samples: list[dict], phase: str) -> dict:
    def mean(metric):
        vals = [r["value"] for r in samples if r["phase"] == phase and r["metric"] == metric and r["gpu"] == 0]
        return sum(vals) / len(vals) if vals else None
    flags = sorted({r["metric"].removeprefix("nvml.throttle.") for r in samples
                    if r["phase"] == phase and r["metric"].startswith("nvml.throttle.") and r["value"] > 0})
    energy = sum(r["value"] for r in samples if r["phase"] == phase and r["metric"] == "nvml.energy_j")
    return {"ofu_pct": mean("nvml.ofu"), "tensor_util_pct": mean("nvml.gpm.tensor_util"),
            "sm_util_pct": mean("nvml.gpm.sm_util"), "sm_clock_mhz": mean("nvml.sm_clock_mhz"),
            "power_w": mean("nvml.power_w"), "energy_j": energy, "throttle_flags_seen": flags}


def main() -> int:
    out_dir = Path(os.environ.get("OUT", "gpu_check_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    sampler = NvmlSampler(os.uname().nodename)
    samples: list[dict] = []
    phase = ["idle"]
    stop = threading.Event()
    thread = threading.Thread(target=sample_loop, args=(sampler, samples, phase, stop), daemon=True)
    thread.start()
    achieved = {}
    try:
        for name, size, dtype in PHASES:
            phase[0] = name
            if size is None:
                time.sleep(PHASE_S)
            else:
                achieved[name] = matmul_phase(size, dtype, PHASE_S)
            print(f"phase {name} done", flush=True)
    finally:
        stop.set()
        thread.join()
        sampler.close()
    summary = {name: {**summarize(samples, name), "tflops": achieved.get(name)} for name, _, _ in PHASES}
    ofu = {k: v["ofu_pct"] for k, v in summary.items()}
    checks = {
        "ofu_present": all(v is not None for v in ofu.values()),
        "ofu_rises_with_tensor_work": None not in (ofu["idle"], ofu["mm8192_bf16"], ofu["mm8192_fp32"])
        and ofu["mm8192_bf16"] > ofu["mm8192_fp32"] and ofu["mm8192_bf16"] > ofu["idle"],
        "throttle_reasons_decoded": any(r["metric"].startswith("nvml.throttle.") for r in samples),
        "statuses": sorted({f'{r["metric"]}:{r["device"]}' for r in samples
                            if r["metric"] in ("nvml.status", "nvml.unsupported", "nvml.gpu_lost")}),
    }
    (out_dir / "samples.json").write_text(json.dumps(samples))
    (out_dir / "summary.json").write_text(json.dumps({"phases": summary, "checks": checks}, indent=2))
    print(json.dumps({"phases": summary, "checks": checks}, indent=2))
    return 0 if checks["ofu_present"] and checks["ofu_rises_with_tensor_work"] else 1


if __name__ == "__main__":
    sys.exit(main())
