"""Sampler cost at a 100 ms interval, as CPU% of one core (issue 4; goal <= 1%).

Measures in one run, interleaved in 1 s rounds so a busy neighbour on this
shared machine hits every variant alike:
  - host: the current HostSampler over this machine's real /proc and /sys;
    the previous implementations (the files at PREVIOUS and at ORIGINAL,
    loaded from git); and a floor that only reads the same files on the same
    cadence (pread on kept-open descriptors, no parsing, no batch);
  - nvml: the current NvmlSampler and the previous ones, all over 8 GPUs
    with every field scripted (an H200-like board: GPM, ECC, remapped rows,
    NVLink, one process each) against the C stand-in in tests/nvml_stub. That
    is fleetscope's side only (ctypes calls, decoding, batch building): real
    NVML adds the driver's time inside each call, which only a GPU can show.
Each tick includes encoding the batch for the wire, as the agent does, with
the fleetscope/wire.py of the variant's own commit (so an encode change counts
where it was made). CPU time is the process's own (time.process_time).
Writes results/sampler_cost.json.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from fleetscope.resources import package_dir  # noqa: E402
from tree_import import import_from  # noqa: E402
from fleetscope import wire  # noqa: E402
from fleetscope.producers.host.collector import build_collectors  # noqa: E402
from fleetscope.producers.host.sampler import HostSampler  # noqa: E402

INTERVAL_S = 0.1
N_GPUS = 8
ROUND_S = 1.0
PREVIOUS = "c281caf"  # the samplers before the latest round of cost work
ORIGINAL = "bf396b0"  # the last commit before any cost work on these samplers


def stub_library(workdir: Path) -> tuple[str, Path]:
    lib = workdir / "libnvidia-ml.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(lib), str(package_dir("fleetscope.eval.gpu_stub") / "fake_nvml.c")],
                   check=True)
    import pynvml

    from fleetscope.producers.nvml.gpm import GPM_METRICS
    energy = " ".join(str(1000 + 65 * k) for k in range(16))
    lines = [f"device_count {N_GPUS}"]
    for i in range(N_GPUS):
        lines += [f"gpu {i} gpu_util 90", f"gpu {i} mem_util 40", f"gpu {i} mem_total 150323855360",
                  f"gpu {i} mem_used 21474836480", f"gpu {i} power_mw 650000", f"gpu {i} energy_mj {energy}",
                  f"gpu {i} temp_c 61", f"gpu {i} sm_clock 1755", f"gpu {i} sm_clock_max 1980",
                  f"gpu {i} mem_clock 2619", f"gpu {i} mem_clock_max 2619", f"gpu {i} throttle 4",
                  f"gpu {i} pcie_tx 1200", f"gpu {i} pcie_rx 3400", f"gpu {i} pcie_replay 5",
                  f"gpu {i} ecc_corrected_volatile 0", f"gpu {i} ecc_uncorrected_volatile 0",
                  f"gpu {i} ecc_corrected_aggregate 2", f"gpu {i} ecc_uncorrected_aggregate 0",
                  f"gpu {i} remapped_corr 0", f"gpu {i} remapped_unc 0", f"gpu {i} remapped_pending 0",
                  f"gpu {i} remapped_failure 0", f"gpu {i} gpm_supported 1",
                  f"gpu {i} proc {1000 + i} 4096", f"gpu {i} putil {1000 + i} 80 30"]
        for fid in (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
                    pynvml.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL,
                    pynvml.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL,
                    pynvml.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL,
                    pynvml.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL):
            lines.append(f"gpu {i} field {fid} 1000")
        lines += [f"gpu {i} gpm {metric_id} 40" for metric_id, _ in GPM_METRICS]
    scenario = workdir / "scenario.txt"
    scenario.write_text("\n".join(lines) + "\n")
    return str(lib), scenario


def load_previous(workdir: Path, commit: str, prefix: str) -> dict | None:
    """The samplers as they were at `commit`, importable as <prefix>_host / <prefix>_nvml, and that
    commit's wire.encode; None without git."""
    for sub in ("host", "nvml"):
        alias = f"{prefix}_{sub}"
        try:
            names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{commit}:producers/{sub}"],
                                   check=True, capture_output=True, text=True).stdout.split()
        except (OSError, subprocess.CalledProcessError) as exc:
            print(f"implementation at {commit} unavailable ({exc}); reporting without it")
            return None
        pkg = workdir / alias
        pkg.mkdir()
        for name in names:
            text = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:producers/{sub}/{name}"],
                                  check=True, capture_output=True, text=True).stdout
            (pkg / name).write_text(text.replace("producers.host.", f"{prefix}_host.")
                                    .replace("producers.nvml.", f"{prefix}_nvml."))
    (workdir / f"{prefix}_wire.py").write_text(subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{commit}:fleetscope/wire.py"], check=True, capture_output=True,
        text=True).stdout)
    old_wire = import_from(workdir, f"{prefix}_wire")
    for sub in ("host", "nvml"):
        import_from(workdir, f"{prefix}_{sub}")
    # The old samplers build today's Batch and StrColumn (they import fleetscope.wire): the old
    # encode must recognize those classes.
    old_wire.Batch, old_wire.StrColumn = wire.Batch, wire.StrColumn
    return {"encode": old_wire.encode, "host": importlib.import_module(f"{prefix}_host.sampler"),
            "host_collector": importlib.import_module(f"{prefix}_host.collector"),
            "nvml": importlib.import_module(f"{prefix}_nvml.sampler")}


class ReadOnlyFloor:
    """Reads the files the host collectors read, on their cadence, and nothing else.

    /proc/stat and /proc/net/dev every tick; the files of the once-a-second
    collectors (Collector.cadence_ns) every tenth tick."""

    EVERY_TICK = ("/proc/stat", "/proc/net/dev")
    ONCE_A_SECOND = ("/proc/meminfo", "/proc/vmstat", "/proc/interrupts", "/proc/diskstats")

    def __init__(self):
        slow = list(self.ONCE_A_SECOND)
        node_dir = "/sys/devices/system/node"
        if os.path.isdir(node_dir):
            slow += [os.path.join(node_dir, n, "numastat") for n in sorted(os.listdir(node_dir))
                     if n.startswith("node") and n[4:].isdigit()]
        self.fast = [os.open(p, os.O_RDONLY) for p in self.EVERY_TICK if os.path.exists(p)]
        self.slow = [os.open(p, os.O_RDONLY) for p in slow if os.path.exists(p)]
        self.ticks = 0

    def sample(self, now_ns):
        fds = self.fast + self.slow if self.ticks % round(1 / INTERVAL_S) == 0 else self.fast
        self.ticks += 1
        for fd in fds:
            os.pread(fd, 1 << 16, 0)
        return None


class Meter:
    def __init__(self, sample, encode=wire.encode):
        self.sample, self.encode, self.ticks, self.events, self.cpu = sample, encode, 0, 0, 0.0

    def tick(self):
        c0 = time.process_time()
        batch = self.sample(time.time_ns())
        if batch is not None:
            self.encode(batch)
            self.events += batch.count
        self.cpu += time.process_time() - c0
        self.ticks += 1

    def result(self) -> dict:
        ms = self.cpu / max(self.ticks, 1) * 1000
        return {"ticks": self.ticks, "events_per_tick": round(self.events / max(self.ticks, 1), 1),
                "cpu_ms_per_tick": round(ms, 3), "cpu_pct_of_one_core_at_100ms": round(ms / (INTERVAL_S * 1000) * 100, 3)}


def interleaved(meters: dict[str, Meter], seconds: float) -> None:
    """Round-robin ROUND_S of 100 ms ticks per variant until each had `seconds`."""
    for _ in range(max(1, round(seconds / ROUND_S))):
        for meter in meters.values():
            next_at = time.monotonic()
            for _ in range(round(ROUND_S / INTERVAL_S)):
                meter.tick()
                next_at += INTERVAL_S
                time.sleep(max(0.0, next_at - time.monotonic()))


def main() -> None:
    seconds = float(os.environ.get("BENCH_SECONDS", "10"))
    with tempfile.TemporaryDirectory() as tmp:
        lib, scenario = stub_library(Path(tmp))
        os.environ["FAKE_NVML_SCENARIO"] = str(scenario)
        baselines = {"previous": load_previous(Path(tmp), PREVIOUS, "prev"),
                     "original": load_previous(Path(tmp), ORIGINAL, "orig")}
        baselines = {name: modules for name, modules in baselines.items() if modules is not None}
        from fleetscope.producers.nvml.sampler import NvmlSampler
        samplers = [NvmlSampler("bench", library_path=lib)]
        meters = {"host": Meter(HostSampler("bench", build_collectors()).sample),
                  "host_read_files_only": Meter(ReadOnlyFloor().sample),
                  "nvml_stub_8_gpus": Meter(samplers[0].sample)}
        for name, modules in baselines.items():
            old_host = modules["host"].HostSampler("bench", modules["host_collector"].build_collectors())
            samplers.append(modules["nvml"].NvmlSampler("bench", library_path=lib))
            meters[f"host_{name}"] = Meter(old_host.sample, modules["encode"])
            meters[f"nvml_stub_8_gpus_{name}"] = Meter(samplers[-1].sample, modules["encode"])
        interleaved(meters, seconds)
        for sampler in samplers:
            sampler.close()
    res = {name: m.result() for name, m in meters.items()}
    pct = {name: r["cpu_pct_of_one_core_at_100ms"] for name, r in res.items()}
    results = {"interval_s": INTERVAL_S, "goal_cpu_pct": 1.0, "cpus": os.cpu_count(), "seconds_per_variant": seconds,
               "previous_commit": PREVIOUS if "previous" in baselines else None,
               "original_commit": ORIGINAL if "original" in baselines else None, **res,
               "combined_cpu_pct": round(pct["host"] + pct["nvml_stub_8_gpus"], 3)}
    for name in baselines:
        combined = round(pct[f"host_{name}"] + pct[f"nvml_stub_8_gpus_{name}"], 3)
        results[f"combined_{name}_cpu_pct"] = combined
        results[f"ratio_to_{name}"] = {
            "host": round(pct["host"] / pct[f"host_{name}"], 3),
            "nvml": round(pct["nvml_stub_8_gpus"] / pct[f"nvml_stub_8_gpus_{name}"], 3),
            "combined": round(results["combined_cpu_pct"] / combined, 3)}
    results["host_ratio_to_read_files_only"] = round(pct["host"] / max(pct["host_read_files_only"], 1e-9), 2)
    results["meets_goal"] = {"host": pct["host"] <= 1.0, "nvml_stub_8_gpus": pct["nvml_stub_8_gpus"] <= 1.0,
                             "combined": results["combined_cpu_pct"] <= 1.0}
    results["note"] = NOTE
    for key, value in results.items():
        print(f"{key}: {value}")
    out = ROOT / "benchmarks/results/sampler_cost.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


NOTE = ("Since previous_commit (c281caf): NVML field values take a fast path (one typed struct unpack, one tuple "
        "compare of every value type and return code, deltas by map() over the previous raw values; anything "
        "unusual takes the general path from the same filled array); NVML rows are kept as per-device runs, so the "
        "metric, device and gpu columns (and the per-process identity columns) are built once per layout; the "
        "process list and utilization are one direct call into a kept buffer per device (pynvml asked for the "
        "count first and built an object per process); GPM results are read with one struct unpack; a tick with "
        "no slower group due skips the cadence check; wire.encode reuses the bytes of read-only columns it saw "
        "before and writes the metadata JSON directly (byte-identical output). No cadence changed and every field "
        "is published as before. Each variant encodes with its own commit's wire.py, so the encode change counts in "
        "the ratios (host gains only from it). nvml numbers are fleetscope's side against a stand-in library; real "
        "NVML adds the driver's time per call, to be measured on a GPU. Host and NVML read slow groups once a "
        "second, so events_per_tick is an average over ticks. Absolute numbers move with the load of this shared "
        "2-core machine (ratios in one run are steadier); each tick runs after a 100 ms sleep, on cold caches, at "
        "3-4x the warm cost. What is left in an NVML fast tick (cold, measured alone): about 0.2 ms in the 48 "
        "ctypes calls and the Python around them, 0.25 ms in the field-values path, 0.15 ms building the batch "
        "(Batch() and three numpy arrays), 0.1 ms encoding; the once-a-second tick costs about twice a fast one.")


if __name__ == "__main__":
    main()
