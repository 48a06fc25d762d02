"""The NVML stand-in for an evaluation run: one healthy fake GPU per rank, changed mid-run by faults.

This machine has no GPU. A scenario that lists `requires: [nvml_standin]` gets the
scripted libnvidia-ml (gpu_stub/fake_nvml.c, built with gcc into the run's data dir),
loaded by the run's agent in place of the driver's. What it reports:

- the scenario file (FAKE_NVML_SCENARIO): `ranks` GPUs, each busy, cool and at its full
  SM clock, with no throttle reason; Xid events can be delivered;
- the control file (FAKE_NVML_CONTROL), which the library re-reads when it changes: each
  rank's process on its own GPU (so the pipeline ties each GPU's features to its rank, as
  the NVML process lists do on a real node), and each active fault's overrides.

Only the NVML side is stood in. The workload side of a fault (slower kernels) is the
workload's own knob; a fault that changes both is real on both sides that this
machine can observe.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from fleetscope.resources import package_dir

HEALTHY = {  # one healthy data-centre GPU (H100-like numbers)
    "gpu_util": 90, "mem_util": 40, "mem_total": 80 << 30, "mem_used": 20 << 30, "power_mw": 400_000,
    "temp_c": 62, "sm_clock": 1980, "sm_clock_max": 1980, "mem_clock": 2619, "mem_clock_max": 2619,
    "throttle": 0, "ecc_uncorrected_volatile": 0, "remapped_pending": 0, "remapped_failure": 0,
    "events_supported": 0x8 | 0x4,  # Xid critical errors and double-bit ECC errors
}
PROCESS_MEM = 4 << 30            # bytes each rank's process holds on its GPU
PROCESS_UTIL = (80, 30)          # its SM and memory utilisation, %
SW_POWER_CAP = 0x4               # nvmlClocksEventReasonSwPowerCap
HW_THERMAL_SLOWDOWN = 0x40       # nvmlClocksEventReasonHwThermalSlowdown


class NvmlStandinError(RuntimeError):
    """The stand-in could not be built or written; the message says why."""


class NvmlStandin:
    def __init__(self, directory: Path, gpus: int):
        if not 1 <= gpus <= 8:
            raise NvmlStandinError(f"the NVML stand-in holds 1 to 8 GPUs, not {gpus}")
        self.dir = Path(directory)
        self.gpus = gpus
        self.library = self.dir / "libnvidia-ml.so.1"
        self.scenario = self.dir / "nvml_scenario.txt"
        self.control = self.dir / "nvml_control.txt"
        self.processes: dict[int, int] = {}                      # gpu -> pid
        self.overrides: dict[str, dict[int, dict[str, object]]] = {}   # owner -> gpu -> key -> value

    def build(self) -> "NvmlStandin":
        if shutil.which("gcc") is None:
            raise NvmlStandinError("gcc is needed to build the NVML stand-in (gpu_stub/fake_nvml.c); install gcc")
        self.dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(self.library),
                        str(package_dir("fleetscope.eval.gpu_stub") / "fake_nvml.c")], check=True)
        lines = [f"device_count {self.gpus}"]
        lines += [f"gpu {g} {key} {value}" for g in range(self.gpus) for key, value in HEALTHY.items()]
        self.scenario.write_text("\n".join(lines) + "\n")
        self._write()
        return self

    def env(self) -> dict[str, str]:
        """What the process that loads the library needs in its environment."""
        return {"FAKE_NVML_SCENARIO": str(self.scenario), "FAKE_NVML_CONTROL": str(self.control)}

    def set_processes(self, pids: dict[int, int]) -> None:
        """{rank: pid}: rank r's process runs on GPU r (a restart's new ranks replace the old)."""
        self.processes = {r: pid for r, pid in pids.items() if 0 <= r < self.gpus}
        self._write()

    def override(self, owner: str, gpu: int, **values) -> None:
        """Report `values` (scenario keys, or `xid=<code>`, delivered once) for `gpu` until clear(owner)."""
        if not 0 <= gpu < self.gpus:
            raise NvmlStandinError(f"GPU {gpu} is not in the stand-in (0..{self.gpus - 1})")
        self.overrides.setdefault(owner, {}).setdefault(gpu, {}).update(values)
        self._write()

    def clear(self, owner: str) -> None:
        if self.overrides.pop(owner, None) is not None:
            self._write()

    def release(self) -> None:
        """After the run: this process's environment and pynvml no longer name the stand-in, so a later run
        (or anything else here) opens the system's NVML again."""
        import pynvml
        for key, value in self.env().items():
            if os.environ.get(key) == value:
                del os.environ[key]
        with pynvml.libLoadLock:
            if pynvml.nvmlLib is not None and pynvml._nvmlLib_refcount == 0:
                pynvml.nvmlLib = None
                pynvml._nvmlGetFunctionPointer_cache.clear()

    def _write(self) -> None:
        lines = []
        for gpu, pid in sorted(self.processes.items()):
            lines += [f"gpu {gpu} proc {pid} {PROCESS_MEM}", f"gpu {gpu} putil {pid} {PROCESS_UTIL[0]} {PROCESS_UTIL[1]}"]
        for per_gpu in self.overrides.values():
            for gpu, values in sorted(per_gpu.items()):
                lines += [f"gpu {gpu} {key} {value}" for key, value in values.items()]
        tmp = self.control.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, self.control)  # the library never reads a half-written file


def throttled_values(kernel_slowdown: float) -> dict[str, object]:
    """What NVML says of a GPU whose kernels take (1 + kernel_slowdown) times as long because its clocks are
    capped: the SM clock falls by that factor, the power cap and heat are the reasons, and the die is hot."""
    factor = 1.0 + kernel_slowdown
    return {"throttle": SW_POWER_CAP | HW_THERMAL_SLOWDOWN, "sm_clock": int(HEALTHY["sm_clock"] / factor),
            "temp_c": 87, "power_mw": 350_000}
