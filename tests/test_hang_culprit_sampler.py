"""python_top_frame_id from real processes: py-spy (producers/tracers/python_sampler.py) samples four real
Python processes of one program, their rows go through the real WindowAssembler and the feature builder
(streams/stack_signature.py). Two ranks in the same function get the same id, ranks in other functions other
ids, whether busy, asleep or blocked in a native wait (as in a collective), which py-spy's samples never see."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from fleetscope.config import Config
from fleetscope.eval.gpu_stub.batches import rows as batch_rows
from fleetscope.producers.identity import IdentityResolver
from fleetscope.producers.tracers.manager import TracerManager
from fleetscope.streams.stack_signature import FEATURE, frame_id, top_frame_features
from fleetscope.streams.windows import WindowAssembler

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="py-spy reads another process's memory: needs root")

PROGRAM = '''
import socket, sys, time
from pathlib import Path

def spin(ready):
    x = 0
    while True:
        x += 1
        if x == 200000:
            ready.touch()

def stuck(ready):
    ready.touch()
    while True:
        time.sleep(0.05)

def blocked(ready):
    a, b = socket.socketpair()
    ready.touch()
    a.recv(1)   # a native wait that never returns, like a peer's collective

{"spin": spin, "stuck": stuck, "blocked": blocked}[sys.argv[1]](Path(sys.argv[2]))
'''
MODES = {0: "spin", 1: "stuck", 2: "spin", 3: "blocked"}   # rank -> what it does


def start_sampled(tmp_path: Path, runs: dict, job: str, sampler) -> dict:
    """Start the program once per `runs` entry (name -> (mode, extra environment)), wait until each is in its
    function (start-up is not), add it to `sampler`; returns {name: process}, every one started kept there."""
    program = tmp_path / "ranks.py"
    program.write_text(PROGRAM)
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    procs = {}
    for name, (mode, env) in runs.items():
        procs[name] = subprocess.Popen([sys.executable, str(program), mode, str(tmp_path / f"ready-{name}")],
                                       env={**base, **env, "FLEETSCOPE_JOB": job})
    deadline = time.monotonic() + 60
    for name, p in procs.items():
        while not (tmp_path / f"ready-{name}").exists():
            assert p.poll() is None and time.monotonic() < deadline, f"{name} did not start"
            time.sleep(0.05)
        assert sampler.add_pid(p.pid)
    return procs


@contextmanager
def sampled(tmp_path: Path, runs: dict, job: str, window_s: int):
    """start_sampled under a PythonSampler; yields (sampler, {name: process}); kills them and closes it after."""
    from fleetscope.producers.tracers.python_sampler import PythonSampler
    sampler = PythonSampler("node-a", resolver=IdentityResolver(host="node-a"), rate_hz=49, window_s=window_s)
    procs: dict = {}
    try:
        procs = start_sampled(tmp_path, runs, job, sampler)
        yield sampler, procs
    finally:
        for p in procs.values():
            p.kill()
            p.wait(timeout=10)
        sampler.close()


def sampled_ranks(tmp_path: Path, modes: dict[int, str], job: str, window_s: int):
    """The program's ranks (RANK set, no world size) in `modes`: sampled() keyed by rank."""
    return sampled(tmp_path, {rank: (mode, {"RANK": str(rank)}) for rank, mode in modes.items()}, job, window_s)


def test_ranks_in_the_same_function_share_an_id_and_the_odd_one_out_differs(tmp_path):
    with sampled_ranks(tmp_path, MODES, "hangtest", window_s=1) as (sampler, procs):
        # the first windows may hold start-up stacks from before a ready file; keep the rows of later ones
        assembler = WindowAssembler(window_s=60.0, allowed_lateness_s=0, idle_close_s=600)
        windows_seen: dict[int, int] = {rank: 0 for rank in MODES}
        by_pid = {p.pid: rank for rank, p in procs.items()}
        deadline = time.monotonic() + 90
        while min(windows_seen.values()) < 3:
            assert time.monotonic() < deadline, f"sampler windows per rank: {windows_seen}"
            batch = sampler.sample()
            if batch is not None:
                pids = set(int(x) for x in batch.columns["pid"])
                for pid in pids:
                    windows_seen[by_pid[pid]] += 1
                if min(windows_seen.values()) >= 2:
                    assembler.add(batch, None)
            time.sleep(0.1)
    ids = {}
    for w in assembler.pop_closed(force=True):
        assert w.key[1] == "hangtest"
        ids.setdefault(w.key[3], set()).add(top_frame_features(w).get(FEATURE))
    module = "ranks"
    assert ids[0] == ids[2] == {frame_id(f"{module}:spin")}, ids
    assert ids[1] == {frame_id(f"{module}:stuck")}, ids
    assert ids[3] == {frame_id(f"{module}:blocked")}, ids


def test_a_rank_that_goes_idle_is_dumped_at_once_not_at_its_window_end(tmp_path):
    """A hung rank and the peers blocked on it go idle together; their stacks are read then (idle_watch.py), in
    the first three ticks of the spell, not at the end of the sampler's window (here 60 s, past the test's
    deadline), and a busy rank's is not."""
    modes = {0: "spin", 1: "stuck", 2: "blocked"}
    tops: dict[int, list[str]] = {rank: [] for rank in modes}
    with sampled_ranks(tmp_path, modes, "idletest", window_s=60) as (sampler, procs):
        by_pid = {p.pid: rank for rank, p in procs.items()}

        def collect():
            batch = sampler.sample()
            for row in batch_rows(batch) if batch is not None else []:   # validated, through the wire codec
                assert row["metric"] == "python.stack_top", row   # the window's own rows wait for its end
                tops[by_pid[int(row["pid"])]].append(row["device"])
        idle = sampler.idle_watch.idle
        deadline = time.monotonic() + 30
        # past the first three ticks of each idle spell (a dump py-spy could not finish under load is not a row)
        while not (tops[1] and tops[2] and idle.get(procs[1].pid, 0) > 3 and idle.get(procs[2].pid, 0) > 3):
            assert time.monotonic() < deadline, f"no dumps of the idle ranks: {tops}"
            collect()
            time.sleep(0.2)
        collect()
    module = "ranks"
    assert not tops[0], tops   # a busy rank is never dumped before its window ends
    assert set(tops[1]) == {f"{module}:stuck"} and set(tops[2]) == {f"{module}:blocked"}, tops
    assert 1 <= len(tops[1]) <= 3 and 1 <= len(tops[2]) <= 3, tops   # no more than three in a spell
    dumped = len(tops[1]) + len(tops[2])
    assert sampler.idle_dumps == dumped
    # counted in the agent's stats (its health rows and /metrics)
    manager = TracerManager(Config(trace_auto=False), tracers={"python_sampler": sampler}, hit_cost_ns=6000.0)
    assert manager.stats()["trace_python_idle_dumps"] == dumped


def test_only_a_rank_of_a_job_of_several_is_dumped_as_it_goes_idle(tmp_path):
    """An idle process that is no rank (an inference server between requests) and a job's only rank have no peer
    to hang with: going idle, they are not dumped (three ~10 ms dumps a spell of the agent's CPU each, for
    nothing). A rank of a job of two is."""
    runs = {"server": ("stuck", {}), "alone": ("stuck", {"RANK": "0", "WORLD_SIZE": "1"}),
            "peer": ("stuck", {"RANK": "1", "WORLD_SIZE": "2"})}
    with sampled(tmp_path, runs, "idlegate", window_s=60) as (sampler, procs):
        dumped: dict[int, int] = {}
        deadline = time.monotonic() + 30
        while sampler.idle_watch.idle.get(procs["peer"].pid, 0) < 3:
            assert time.monotonic() < deadline, "the idle rank was never judged idle three times"
            batch = sampler.sample()
            for row in batch_rows(batch) if batch is not None else []:
                dumped[int(row["pid"])] = dumped.get(int(row["pid"]), 0) + 1
            time.sleep(0.2)
        assert procs["server"].pid not in sampler.idle_watch.idle and procs["alone"].pid not in sampler.idle_watch.idle
        assert set(dumped) <= {procs["peer"].pid}, dumped
        assert sampler.idle_dumps == dumped.get(procs["peer"].pid, 0)
