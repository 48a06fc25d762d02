"""The tracing check for a lent GPU machine (issue 3, "On a GPU"). Not run on a GPU yet: this task had no device.

One job process trains a small MLP with real CUDA PyTorch and, when the communicator can
be formed, all-reduces its gradients through torch.distributed's NCCL backend at world
size 1. This process traces it with our CudaTracer, NcclTracer and TorchTracer (uprobes on
the libcudart/libcuda/libnccl/libtorch_python the job maps) and writes
$OUT/gpu_trace_summary.json (or --out): per-API calls, bytes and latencies, kernel names,
NCCL collectives, torch ops, errors and lost events, and the tracers' cost on steps/s.

Overhead is measured inside one job process, so process-to-process variance stays out:
segments of the same steps run untraced, traced (tracers attached to its pid), untraced
again, for a launch-bound small model and a compute-bound larger one.

The device machine reaches no registry. Its image has PyTorch and numpy, not bcc and not
kernel headers; `bash benchmarks/gpu_trace_bundle.sh` packs Debian's bcc, the libraries it
loads and the headers into .gpu_bundle/, which the run carries:

    device run, carry [".gpu_bundle"], timeout_s 540:
      PYTHONUNBUFFERED=1 python3 benchmarks/gpu_trace_check.py 2>&1 | tee $OUT/gpu_trace_check.log
    here, on the CPU (no GPU): .venv/bin/python benchmarks/gpu_trace_check.py --dry-run --out /tmp/gtc

--dry-run runs every non-GPU part for real: the bundle/bcc set-up checks, the job on the
CPU with the gloo backend, TorchTracer on it (the CUDA/NCCL tracers find no CUDA library
and say so), the summary and its checks. Each phase has a time box; the whole run stays
under --budget-s (default 450 s). A phase that fails is recorded with its reason and the
run goes on; the summary's "checks" say what passed, failed or could not be checked.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / ".gpu_bundle" / "bcc-bundle.tar.xz"
BCC_ROOT = Path("/tmp/fleetscope-bcc")
SIZES = {"small": (512, 1024, 256), "large": (4096, 8192, 1024)}  # (in/out features, hidden, batch)
CLASSES = 1000


# -- the job (a child process) ------------------------------------------------
def job_main(cpu: bool) -> int:
    """Build the models, print {"ready"...}, then run `run LABEL SIZE STEPS MAX_S` lines from stdin."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    dev = "cpu" if cpu else "cuda"
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": dev}
    if not cpu:
        torch.cuda.set_device(0)
        info["device_name"] = torch.cuda.get_device_name(0)
        try:
            v = torch.cuda.nccl.version()
            info["nccl_version"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            info["nccl_version"] = f"unknown ({e})"
    store = Path(os.environ.get("GTC_STORE", "/tmp/gtc-store"))
    store.unlink(missing_ok=True)
    pg = None
    try:
        dist.init_process_group("gloo" if cpu else "nccl", init_method=f"file://{store}", world_size=1, rank=0)
        pg = dist.group.WORLD
    except Exception as e:  # noqa: BLE001 - the summary says why
        info["pg_error"] = f"{type(e).__name__}: {e}"
    info["backend"] = dist.get_backend() if pg is not None else None
    models = {}
    for name, (d, h, b) in SIZES.items():
        if cpu:
            d, h, b = d // 8, h // 8, b // 4
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, CLASSES)).to(dev)
        x = torch.randn(b, d)
        y = torch.randint(0, CLASSES, (b,))
        if not cpu:
            x, y = x.pin_memory(), y.pin_memory()
        params = list(model.parameters())
        models[name] = (model, torch.optim.SGD(params, lr=0.01), x, y, params)
    info["grad_bytes"] = {n: sum(p.numel() for p in m[4]) * 4 for n, m in models.items()}
    info["batch_bytes"] = {n: m[2].numel() * 4 + m[3].numel() * 8 for n, m in models.items()}
    print(json.dumps({"ready": True, "pid": os.getpid(), **info}), flush=True)

    def step(name):
        model, opt, hx, hy, params = models[name]
        x, y = hx.to(dev, non_blocking=True), hy.to(dev, non_blocking=True)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if pg is not None:  # one flat bucket, as DDP does
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            off = 0
            for p in params:
                p.grad.copy_(flat[off:off + p.numel()].view_as(p.grad))
                off += p.numel()
        opt.step()
        return loss.item()  # a DtoH copy and a sync every step

    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        _, label, name, steps, max_s = cmd
        t0, n, loss = time.perf_counter(), 0, float("nan")
        while n < int(steps) and time.perf_counter() - t0 < float(max_s):
            loss = step(name)
            n += 1
        if not cpu:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        print(json.dumps({"label": label, "size": name, "steps": n, "seconds": round(dt, 4),
                          "steps_per_s": round(n / dt, 3) if dt else 0.0, "loss": loss}), flush=True)
    if pg is not None:
        dist.destroy_process_group()
    return 0


class Job:
    """The job process: send commands, read one JSON line per command with a time box."""

    def __init__(self, cpu: bool, log: Path):
        env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD")}
        env.update(PYTHONUNBUFFERED="1", GTC_STORE=f"/tmp/gtc-store-{os.getpid()}")
        self.log = open(log, "ab")
        self.proc = subprocess.Popen([sys.executable, __file__, "--job", *(["--cpu"] if cpu else [])],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, cwd=REPO)

    def read(self, timeout_s: float) -> dict:
        box: list[str] = []
        t = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(max(timeout_s, 0.1))
        if not box or not box[0]:
            raise TimeoutError(f"the job said nothing within {timeout_s:.0f} s (exit {self.proc.poll()})")
        return json.loads(box[0])

    def run(self, label: str, size: str, steps: int, max_s: float) -> dict:
        self.proc.stdin.write(f"run {label} {size} {steps} {max_s:.1f}\n")
        self.proc.stdin.flush()
        return self.read(max_s + 60)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# -- set-up ---------------------------------------------------------------------
def sh(cmd: list[str], timeout_s: float = 20) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        return (r.stdout + r.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unavailable: {e}"


def machine_facts() -> dict:
    kver = platform.release()
    build = Path(f"/lib/modules/{kver}/build")
    return {
        "kernel": kver, "python": sys.version.split()[0], "executable": sys.executable,
        "glibc": platform.libc_ver()[1], "nvidia_smi": sh(["nvidia-smi", "-L"]),
        "btf": Path("/sys/kernel/btf/vmlinux").exists(), "kheaders": Path("/sys/kernel/kheaders.tar.xz").exists(),
        "uprobe_pmu": Path("/sys/bus/event_source/devices/uprobe").exists(),
        "headers_build": str(build.resolve()) if (build / "Makefile").exists() else None,
        "tracefs": os.path.ismount("/sys/kernel/tracing"), "root": os.geteuid() == 0,
        "nm": shutil.which("nm"), "cxxfilt": shutil.which("c++filt"), "bundle": BUNDLE.exists(),
    }


def _preload(lib_dir: Path) -> list[str]:
    """Load the bundle's libraries by path where the system lacks the soname, leaves first.

    dlopen() of a soname that is already loaded returns that object, so bcc's own
    CDLL("libbcc.so.0") then finds these; the system's (newer) copies win where present,
    and nothing goes on LD_LIBRARY_PATH (the job process must keep the image's libraries)."""
    todo, loaded = sorted(p for p in lib_dir.iterdir() if ".so" in p.name), []
    for p in list(todo):
        try:
            ctypes.CDLL(p.name, mode=ctypes.RTLD_GLOBAL)  # the system has it
            todo.remove(p)
        except OSError:
            pass
    while todo:
        progress = False
        for p in list(todo):
            try:
                ctypes.CDLL(str(p), mode=ctypes.RTLD_GLOBAL)
                todo.remove(p)
                loaded.append(p.name)
                progress = True
            except OSError:
                continue
        if not progress:
            errs = []
            for p in todo:
                try:
                    ctypes.CDLL(str(p), mode=ctypes.RTLD_GLOBAL)
                except OSError as e:
                    errs.append(str(e))
            raise RuntimeError(f"cannot load the bundled libraries: {'; '.join(errs)}")
    return loaded


def setup_bcc(dry_run: bool) -> dict:
    """Make `from bcc import BPF` work and give bcc kernel headers; report what was done."""
    out: dict = {"actions": []}
    try:
        import bcc  # noqa: F401
        out["bcc"] = "system"
    except ImportError as e:
        if not BUNDLE.exists():
            raise RuntimeError(f"bcc is not importable ({e}) and {BUNDLE} is missing: run "
                               "benchmarks/gpu_trace_bundle.sh here and carry .gpu_bundle") from None
        if not (BCC_ROOT / "MANIFEST").exists():
            BCC_ROOT.mkdir(parents=True, exist_ok=True)
            with tarfile.open(BUNDLE) as tf:
                tf.extractall(BCC_ROOT, filter="tar") if hasattr(tarfile, "data_filter") else tf.extractall(BCC_ROOT)
            out["actions"].append(f"unpacked {BUNDLE.name} to {BCC_ROOT}")
        out["preloaded"] = _preload(BCC_ROOT / "lib")
        from tree_import import import_from
        import_from(BCC_ROOT / "python", "bcc")
        out["bcc"] = "bundle"
    kver = platform.release()
    mod = Path(f"/lib/modules/{kver}")
    if not (mod / "build" / "Makefile").exists() and not Path("/sys/kernel/kheaders.tar.xz").exists():
        src = sorted((BCC_ROOT / "usr" / "src").glob("linux-headers-*")) if BCC_ROOT.exists() else []
        arch = [p for p in src if not p.name.endswith("-common")]
        common = [p for p in src if p.name.endswith("-common")]
        if not arch:
            raise RuntimeError(f"no kernel headers for {kver} and none in the bundle: bcc cannot compile")
        if dry_run:
            out["actions"].append(f"would link {mod}/build -> {arch[-1]} (dry run: left alone)")
        else:
            mod.mkdir(parents=True, exist_ok=True)
            for name, target in (("build", arch[-1]), ("source", (common or arch)[-1])):
                link = mod / name
                if link.is_symlink() or link.exists():
                    link.unlink()
                link.symlink_to(target)
            os.environ["BCC_KERNEL_SOURCE"] = str(arch[-1])
            out["actions"].append(f"linked {mod}/build -> {arch[-1]} (headers of another kernel; fine for uprobes)")
    for fs, path in (("tracefs", "/sys/kernel/tracing"), ("debugfs", "/sys/kernel/debug")):
        if not os.path.ismount(path) and not dry_run:
            r = subprocess.run(["mount", "-t", fs, fs, path], capture_output=True, text=True)
            out["actions"].append(f"mount {fs}: {'ok' if r.returncode == 0 else r.stderr.strip()}")
    return out


# -- tracing --------------------------------------------------------------------
def make_tracers(errors: dict) -> dict:
    from fleetscope.producers.tracers.cuda import CudaTracer
    from fleetscope.producers.tracers.nccl import NcclTracer
    from fleetscope.producers.tracers.torch_ops import TorchTracer
    tracers = {}
    for name, cls in (("cuda", CudaTracer), ("nccl", NcclTracer), ("torch", TorchTracer)):
        t0 = time.monotonic()
        try:
            tracers[name] = cls("gpu-check")
            errors.setdefault("load_s", {})[name] = round(time.monotonic() - t0, 2)
        except Exception as e:  # noqa: BLE001 - TracerUnavailable or a compile error: say which
            errors[name] = f"{type(e).__name__}: {e}"
    return tracers


def attach(tracers: dict, pid: int) -> dict:
    out = {}
    for name, t in tracers.items():
        t0 = time.monotonic()
        out[name] = {"attached": bool(t.add_pid(pid)), "s": round(time.monotonic() - t0, 3)}
        if name in ("cuda", "nccl"):
            out[name]["libraries"] = t.libs.get(pid, {})
    return out


def detach(tracers: dict, pid: int) -> None:
    for t in tracers.values():
        try:
            t.remove_pid(pid)
        except Exception:  # noqa: BLE001 - detaching from a live pid should not fail; logged
            traceback.print_exc()


def rows_of(batch) -> list[dict]:
    from fleetscope import wire
    from fleetscope.schema import validate
    validate(batch)
    back = wire.decode(wire.encode(batch))  # the wire round trip a consumer would do
    cols = {k: (v.to_numpy() if isinstance(v, wire.StrColumn) else v) for k, v in back.columns.items()}
    return [{k: cols[k][i] for k in cols} for i in range(back.count)]


def summarize(batches: list, pid: int, steps: int) -> dict:
    """Per-source, per-device metrics of one traced segment (deltas summed, gauges last)."""
    out: dict = {}
    for b in batches:
        if b is None:
            continue
        for r in rows_of(b):
            if int(r["pid"]) not in (pid, 0):
                continue
            metric, dev, v = str(r["metric"]), str(r["device"]), float(r["value"])
            src, name = metric.split(".", 1)
            slot = out.setdefault(src, {}).setdefault(name, {})
            slot[dev] = v if r["interval_ns"] == 0 else slot.get(dev, 0.0) + v
    for src in out.values():
        if "calls" in src:
            src["calls_per_step"] = {k: round(v / max(steps, 1), 3) for k, v in src["calls"].items()}
    launches = out.get("cuda", {}).get("launches", {})
    if launches:
        top = sorted(launches.items(), key=lambda kv: -kv[1])
        out["cuda"]["launches"] = dict(top[:40])
        out["cuda"]["kernel_names_distinct"] = len(top)
    return out


def run_checks(res: dict, cpu: bool) -> list[dict]:
    checks = []

    def check(name, ok, detail="", needs_gpu=False):
        if needs_gpu and cpu:
            checks.append({"name": name, "status": "not checked (dry run: no GPU)", "detail": detail})
        elif ok is None:
            checks.append({"name": name, "status": "not checked", "detail": detail})
        else:
            checks.append({"name": name, "status": "pass" if ok else "FAIL", "detail": detail})

    traced = res.get("segments", {}).get("traced_small", {})
    tr = traced.get("trace", {})
    steps = traced.get("steps", 0)
    info = res.get("job", {})
    cuda, nccl, torch_ = tr.get("cuda", {}), tr.get("nccl", {}), tr.get("torch", {})
    calls = cuda.get("calls", {})
    launches = sum(v for k, v in calls.items() if "Launch" in k)
    check("gpu present", "H200" in str(res.get("machine", {}).get("nvidia_smi", "")) or None,
          res.get("machine", {}).get("nvidia_smi", ""), needs_gpu=True)
    check("bcc ready", "bcc" in res.get("bcc", {}), res.get("bcc", {}).get("error", ""))
    check("cuda tracer attached", res.get("attach", {}).get("cuda", {}).get("attached"), res.get("tracer_errors", {}).get("cuda", ""), needs_gpu=True)
    check("kernel launches seen (>= 5 per step)", launches >= 5 * steps if steps else None, f"{launches} launches, {steps} steps", needs_gpu=True)
    names = [k for k in cuda.get("launches", {}) if not k.startswith(("0x", "CUfunction@", "other"))]
    check("kernel names resolved", bool(names) if calls else None, ", ".join(names[:5]), needs_gpu=True)
    htod = cuda.get("memcpy_bytes", {}).get("HtoD", 0)
    want = info.get("batch_bytes", {}).get("small", 0) * steps
    check("HtoD bytes >= batch bytes x steps", htod >= want if calls else None, f"{htod:.0f} vs {want}", needs_gpu=True)
    if info.get("backend") == "nccl":
        ar = nccl.get("calls", {}).get("AllReduce", 0)
        per = nccl.get("bytes", {}).get("AllReduce", 0) / ar if ar else 0
        check("ncclAllReduce once per step, gradient bytes", ar >= steps and per == info["grad_bytes"]["small"],
              f"{ar} calls, {per:.0f} B/call vs {info['grad_bytes']['small']}", needs_gpu=True)
    else:
        check("NCCL communicator", None, info.get("pg_error", "not formed"), needs_gpu=True)
    ops = set(torch_.get("ops", {}))
    check("torch ops linear, relu, backward seen", {"linear", "relu", "backward"} <= ops if torch_ else None,
          ", ".join(sorted(ops)) or res.get("tracer_errors", {}).get("torch", ""))
    lost = {s: sum(v.get("lost_events", {}).values()) for s, v in tr.items() if isinstance(v, dict)}
    check("no lost events", not any(lost.values()) if tr else None, json.dumps(lost))
    errs = sum(cuda.get("errors", {}).values()) + sum(nccl.get("errors", {}).values())
    check("no CUDA/NCCL error returns", errs == 0 if calls else None, f"{errs:.0f}", needs_gpu=True)
    return checks


# -- the run --------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU only: run the non-GPU parts for real")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_trace_out"))
    p.add_argument("--budget-s", type=float, default=450.0)
    p.add_argument("--steps", type=int, default=0, help="steps per segment (default 300, 40 in a dry run)")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.job:
        return job_main(a.cpu)
    try:
        import fleetscope.producers  # noqa: F401
    except ImportError:
        raise SystemExit("fleetscope is not installed here: `pip install --no-deps .` (or the README's installer) "
                         "first, then rerun") from None
    cpu = a.dry_run
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    left = lambda: a.budget_s - (time.monotonic() - start)  # noqa: E731
    res: dict = {"dry_run": cpu, "phases": {}, "segments": {}}
    summary_path = out_dir / "gpu_trace_summary.json"

    def phase(name, fn, cap_s):
        t0 = time.monotonic()
        if left() < 20:
            res["phases"][name] = {"status": "skipped", "why": f"{left():.0f} s of the budget left"}
            return None
        try:
            value = fn(min(cap_s, left() - 15))
            res["phases"][name] = {"status": "ok", "s": round(time.monotonic() - t0, 1)}
            return value
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            res["phases"][name] = {"status": "failed", "s": round(time.monotonic() - t0, 1),
                                   "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
            print(f"gpu_trace_check: phase {name} failed: {e}", file=sys.stderr, flush=True)
            return None
        finally:
            summary_path.write_text(json.dumps(res, indent=1, default=str))  # a partial summary survives a kill

    res["machine"] = phase("machine", lambda cap: machine_facts(), 30)
    bcc_info = phase("bcc", lambda cap: setup_bcc(cpu), 90)
    res["bcc"] = bcc_info or {"error": res["phases"]["bcc"].get("error", "")}
    res["tracer_errors"] = {}
    tracers = phase("load_tracers", lambda cap: make_tracers(res["tracer_errors"]), 120) if bcc_info else {}
    tracers = tracers or {}
    steps = a.steps or (40 if cpu else 300)
    job = Job(cpu, out_dir / "job.log")
    try:
        res["job"] = phase("job_start", lambda cap: job.read(cap), 120)
        pid = (res["job"] or {}).get("pid")
        if pid:
            def traced_segment(label, size, cap):
                res["attach"] = attach(tracers, pid)
                for t in tracers.values():
                    t.sample()  # start this segment's interval
                seg = job.run(label, size, steps, cap)
                seg["trace"] = summarize([t.sample() for t in tracers.values()], pid, seg["steps"])
                detach(tracers, pid)
                return seg

            warm = phase("warmup_traced", lambda cap: traced_segment("warmup", "small", min(cap, 60)), 90)
            if warm:
                warm["steps_note"] = "first steps: CUDA/cuBLAS/NCCL set-up, allocator growth"
                res["segments"]["warmup_traced"] = warm
            for size in SIZES:
                for label in ("untraced_a", "traced", "untraced_b"):
                    key = f"{label}_{size}"
                    fn = (lambda cap, s=size: traced_segment("traced", s, min(cap, 45))) if label == "traced" \
                        else (lambda cap, s=size, lb=label: job.run(lb, s, steps, min(cap, 45)))
                    seg = phase(key, fn, 60)
                    if seg:
                        res["segments"][key] = seg
                u = [res["segments"].get(f"untraced_{x}_{size}", {}).get("steps_per_s") for x in "ab"]
                t = res["segments"].get(f"traced_{size}", {}).get("steps_per_s")
                if t and all(u):
                    base = sum(u) / 2
                    res.setdefault("overhead", {})[size] = {
                        "untraced_steps_per_s": u, "traced_steps_per_s": t,
                        "slowdown_pct": round(100 * (1 - t / base), 2),
                        "untraced_spread_pct": round(100 * abs(u[0] - u[1]) / base, 2)}
    finally:
        job.close()
        for t in tracers.values():
            t.close()
    res["checks"] = run_checks(res, cpu)
    res["wall_s"] = round(time.monotonic() - start, 1)
    summary_path.write_text(json.dumps(res, indent=1, default=str))
    failed = [c["name"] for c in res["checks"] if c["status"] == "FAIL"]
    for c in res["checks"]:
        print(f"{c['status']:>32}  {c['name']}  {c['detail'][:100]}")
    print(json.dumps({"overhead": res.get("overhead"), "phases": {k: v["status"] for k, v in res["phases"].items()},
                      "wall_s": res["wall_s"], "summary": str(summary_path)}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
