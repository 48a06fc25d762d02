"""Workload (a): real PyTorch DDP training on the CPU with the gloo backend.

Run one process per rank with a torchrun-style environment (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID); `benchmarks/workloads/launch.py` does that
through torchrun. A few Linear layers train on synthetic data; each rank sleeps
`--sleep-ms` per step so that 2 ranks leave CPU for the agent beside them.

At the end each rank prints one JSON line to stdout (and writes it to
`$FLEETSCOPE_WORKLOAD_RESULT_DIR/rank<RANK>.json` when that is set):
    {"workload": "ddp_train", "rank": 0, "world_size": 2, "steps": 50, "elapsed_s": 2.1,
     "steps_per_s": 23.8, "pid": 1234, "faults_seen": [...]}
With `--progress-s S`, rank 0 also prints {"progress_steps": N, "t_monotonic": T} every S
seconds while it trains, so a reader can time any stretch of a long run.

Opt-in fault knobs (the workload is ours; the fault injector never edits this code).
Some faults live inside a training process and cannot be caused from outside without
changing the program (a GC storm, a slow input pipeline). For those the workload reads
FLEETSCOPE_WORKLOAD_CONTROL_DIR at start; if set, it checks `<dir>/rank<RANK>.json` each
step (one stat call) and applies what the file asks for while it exists:
    {"gc_storm": {"cycles_per_step": 20000}}      allocate and drop reference cycles
    {"dataloader_stall": {"ms_per_batch": 80, "read_mb_per_batch": 8}}
                                                  fetching a batch reads its data from storage,
                                                  uncached, and blocks like slow storage
    {"hang": {"poll_ms": 50}}                     the rank stops calling collectives (its peers wait
                                                  in the all-reduce) until the entry is removed
Without the variable, no knob exists and nothing is checked.

Phases, as a real job has them: `--eval-every N --eval-steps K` runs a forward-only pass over K
batches every N steps (no collectives); `--ckpt-every M --ckpt-mb S` writes S MB of state to a file
in the control dir (or a temp dir) and fsyncs it every M steps.
Per-rank arguments: `--rank-args '{"1": {"batch": 128}}'` gives one rank its own batch, sleep or
threads, so a rank can differ from its peers by design.
Progress: with FLEETSCOPE_WORKLOAD_PROGRESS_DIR set, every rank appends
{"t": unix time, "steps": N, "pid": P} to `<dir>/progress-rank<RANK>.jsonl` about every 0.25 s
while it steps, so the harness can measure each rank's step rate in each window.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

CONTROL_ENV = "FLEETSCOPE_WORKLOAD_CONTROL_DIR"
RESULT_ENV = "FLEETSCOPE_WORKLOAD_RESULT_DIR"
PROGRESS_ENV = "FLEETSCOPE_WORKLOAD_PROGRESS_DIR"
PROGRESS_EVERY_S = 0.25
RANK_ARGS = {"batch": int, "sleep_ms": float, "threads": int}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: use --duration-s)")
    p.add_argument("--duration-s", type=float, default=30.0, help="stop after this long when --steps is 0")
    p.add_argument("--sleep-ms", type=float, default=20.0, help="sleep per step, to keep the CPU share light")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress-s", type=float, default=0.0,
                   help="rank 0 prints its step count and CLOCK_MONOTONIC every this many seconds (0: never)")
    p.add_argument("--eval-every", type=int, default=0, help="an evaluation pass every this many steps (0: none)")
    p.add_argument("--eval-steps", type=int, default=10, help="batches per evaluation pass")
    p.add_argument("--ckpt-every", type=int, default=0, help="a checkpoint write every this many steps (0: none)")
    p.add_argument("--ckpt-mb", type=float, default=16.0, help="size of each checkpoint write")
    p.add_argument("--rank-args", default="{}",
                   help='per-rank overrides as JSON, e.g. \'{"1": {"batch": 128, "sleep_ms": 30}}\'')
    args = p.parse_args(argv)
    if args.steps <= 0 and args.duration_s <= 0:
        p.error("give --steps > 0 or --duration-s > 0")
    try:
        rank_args = json.loads(args.rank_args)
        if not isinstance(rank_args, dict):
            raise ValueError("not a mapping")
        for r, over in rank_args.items():
            int(r)
            bad = set(over) - set(RANK_ARGS)
            if bad:
                raise ValueError(f"rank {r}: unknown {sorted(bad)}; known {sorted(RANK_ARGS)}")
    except (ValueError, TypeError, AttributeError) as e:
        p.error(f"--rank-args: {e}")
    args.rank_args = {int(r): over for r, over in rank_args.items()}
    return args


def apply_rank_args(args: argparse.Namespace, rank: int) -> None:
    """This rank's own batch, sleep or threads (from --rank-args) replace the common ones."""
    for k, v in args.rank_args.get(rank, {}).items():
        setattr(args, k, RANK_ARGS[k](v))


class Progress:
    """Appends {"t", "steps", "pid"} lines to this rank's progress file, at most every 0.25 s."""

    def __init__(self, rank: int):
        base = os.environ.get(PROGRESS_ENV)
        self.f = open(os.path.join(base, f"progress-rank{rank}.jsonl"), "a") if base else None
        self.next_t = 0.0

    def step(self, steps: int) -> None:
        if self.f is None:
            return
        now = time.time()
        if now >= self.next_t:
            self.f.write(json.dumps({"t": now, "steps": steps, "pid": os.getpid()}) + "\n")
            self.f.flush()
            self.next_t = now + PROGRESS_EVERY_S

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


def evaluation_pass(model: nn.Module, loader, batches: int) -> None:
    """Forward only, no gradients, no collectives: the other phase a training job runs."""
    with torch.no_grad():
        for _ in range(batches):
            x, _y = next(loader)
            model(x)


def write_checkpoint(model: nn.Module, directory: str, mb: float, rank: int) -> None:
    """Write `mb` MB (the parameters, repeated) to a file and fsync it, as torch.save would."""
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tobytes()
    want = int(mb * (1 << 20))
    path = os.path.join(directory, f"ckpt-rank{rank}.bin")
    with open(path, "wb") as f:
        written = 0
        while written < want:
            chunk = params[: want - written]
            f.write(chunk)
            written += len(chunk)
        f.flush()
        os.fsync(f.fileno())


class Control:
    """The per-rank control file for opt-in faults; re-read only when its mtime changes."""

    def __init__(self, rank: int):
        base = os.environ.get(CONTROL_ENV)
        self.path = os.path.join(base, f"rank{rank}.json") if base else None
        self.knobs: dict = {}
        self.seen: set[str] = set()
        self._mtime: float | None = None

    def poll(self) -> dict:
        if self.path is None:
            return self.knobs
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            self.knobs, self._mtime = {}, None
            return self.knobs
        if mtime != self._mtime:
            try:
                with open(self.path) as f:
                    self.knobs = json.load(f)
            except (OSError, ValueError) as e:  # a half-written file: keep the old knobs, say so
                print(f"ddp_train: cannot read {self.path}: {e}", file=sys.stderr)
                return self.knobs
            self._mtime = mtime
            self.seen.update(self.knobs)
        return self.knobs


class SyntheticData(Dataset):
    """Random regression data, generated per item."""

    def __init__(self, features: int, rank: int, world: int, length: int = 1 << 30):
        self.features, self.rank, self.world, self.length = features, rank, world, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed((i * self.world + self.rank) % (1 << 32))  # rank-disjoint
        x = torch.randn(self.features, generator=g)
        return x, x[:8].sum(dim=0, keepdim=True)


def make_model(features: int, hidden: int, layers: int) -> nn.Module:
    mods: list[nn.Module] = [nn.Linear(features, hidden), nn.ReLU()]
    for _ in range(layers - 1):
        mods += [nn.Linear(hidden, hidden), nn.ReLU()]
    mods.append(nn.Linear(hidden, 1))
    return nn.Sequential(*mods)


def gc_storm(cycles: int) -> None:
    """Allocate reference cycles and drop them: only the cyclic GC can free them."""
    for _ in range(cycles):
        a: list = []
        a.append(a)


class SlowStorage:
    """A batch's data read from a scratch file with its page cache dropped first, so the bytes
    come from the block device (the process's read_bytes in /proc/<pid>/io count them); the
    fetch then blocks until `ms_per_batch` have passed, as storage slower than this disk would."""

    def __init__(self, directory: str, size_mb: int = 64):
        self.path = os.path.join(directory, f"scratch-{os.getpid()}.bin")
        self.size = size_mb << 20
        self.fd: int | None = None
        self.offset = 0

    def _open(self) -> int:
        if self.fd is None:
            with open(self.path, "wb") as f:
                for _ in range(self.size >> 20):
                    f.write(os.urandom(1 << 20))
                f.flush()
                os.fsync(f.fileno())
            self.fd = os.open(self.path, os.O_RDONLY)
        return self.fd

    def fetch(self, read_mb: float, ms: float) -> None:
        t0 = time.monotonic()
        fd, want = self._open(), min(int(read_mb * (1 << 20)), self.size)
        if self.offset + want > self.size:
            self.offset = 0
        os.posix_fadvise(fd, self.offset, want, os.POSIX_FADV_DONTNEED)
        done = 0
        while done < want:
            chunk = os.pread(fd, min(1 << 20, want - done), self.offset + done)
            if not chunk:
                break
            done += len(chunk)
        self.offset += want
        time.sleep(max(0.0, ms / 1000.0 - (time.monotonic() - t0)))

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if os.path.exists(self.path):
            os.unlink(self.path)


def hang_while_set(control: "Control") -> None:
    """The hang knob: no collective is called while it is set; the control file is still polled."""
    while "hang" in (knobs := control.poll()):
        time.sleep(float(knobs["hang"].get("poll_ms", 50)) / 1000.0)


def apply_knobs(knobs: dict, storage: SlowStorage | None = None) -> None:
    if "gc_storm" in knobs:
        gc_storm(int(knobs["gc_storm"].get("cycles_per_step", 20000)))
    if "dataloader_stall" in knobs:
        stall = knobs["dataloader_stall"]
        ms = float(stall.get("ms_per_batch", 80))
        if storage is None:
            time.sleep(ms / 1000.0)
        else:
            storage.fetch(float(stall.get("read_mb_per_batch", 8)), ms)


def all_ranks_past(deadline: float) -> bool:
    """True once any rank's clock has passed the deadline, agreed by all ranks.

    Each rank reading its own clock would let one rank leave the loop a step early and
    wait in the final barrier while the others wait in that step's all-reduce: a hang."""
    flag = torch.tensor([1.0 if time.monotonic() >= deadline else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def main(argv=None) -> int:
    args = parse_args(argv)
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        print(f"ddp_train: missing {', '.join(missing)} in the environment; start it with torchrun "
              "or benchmarks/workloads/launch.py", file=sys.stderr)
        return 2
    apply_rank_args(args, int(os.environ["RANK"]))
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    progress = Progress(rank)
    scratch = os.environ.get(CONTROL_ENV) or os.environ.get("TMPDIR", "/tmp")
    control = Control(rank)
    storage = SlowStorage(os.environ[CONTROL_ENV]) if os.environ.get(CONTROL_ENV) else None
    data = SyntheticData(args.features, rank, world)
    loader = iter(DataLoader(data, batch_size=args.batch, num_workers=0))  # sequential: lazy
    model = DistributedDataParallel(make_model(args.features, args.hidden, args.layers))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()
    sleep_s = args.sleep_ms / 1000.0

    dist.barrier()
    t0 = time.monotonic()
    deadline = t0 + args.duration_s
    steps = 0
    progress_at = t0 + args.progress_s if args.progress_s > 0 and rank == 0 else float("inf")
    while (steps < args.steps) if args.steps > 0 else not all_ranks_past(deadline):
        knobs = control.poll()
        if "hang" in knobs:
            hang_while_set(control)
            knobs = control.poll()
        apply_knobs(knobs, storage)  # the input pipeline and the interpreter, before the batch is used
        x, y = next(loader)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()  # DDP all-reduces gradients here over gloo
        opt.step()
        steps += 1
        progress.step(steps)
        if args.eval_every and steps % args.eval_every == 0:
            evaluation_pass(model, loader, args.eval_steps)
        if args.ckpt_every and steps % args.ckpt_every == 0:
            write_checkpoint(model, scratch, args.ckpt_mb, rank)
        if (now := time.monotonic()) >= progress_at:
            print(json.dumps({"progress_steps": steps, "t_monotonic": now}), flush=True)
            progress_at = now + args.progress_s
        if sleep_s > 0:
            time.sleep(sleep_s)
    elapsed = time.monotonic() - t0
    # Steps/s measured before the final barrier, which waits for the slowest rank.
    dist.barrier()
    result = json.dumps({"workload": "ddp_train", "rank": rank, "world_size": world, "steps": steps,
                         "elapsed_s": round(elapsed, 4), "steps_per_s": round(steps / elapsed, 4),
                         "pid": os.getpid(), "loss": round(loss.item(), 6), "faults_seen": sorted(control.seen)})
    print(result, flush=True)
    if os.environ.get(RESULT_ENV):  # the launcher reads these; stdout can be shared by many ranks
        with open(os.path.join(os.environ[RESULT_ENV], f"rank{rank}.json"), "w") as f:
            f.write(result)
    dist.destroy_process_group()
    progress.close()
    if storage is not None:
        storage.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
