"""python_top_frame_id from real processes: py-spy (producers/tracers/python_sampler.py) samples four real
Python processes of one program, their rows go through the real WindowAssembler and the feature builder
(streams/stack_signature.py). Two ranks in the same function get the same id, ranks in other functions other
ids, whether busy, asleep or blocked in a native wait (as in a collective), which py-spy's samples never see."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetscope.producers.identity import IdentityResolver
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


def test_ranks_in_the_same_function_share_an_id_and_the_odd_one_out_differs(tmp_path):
    from fleetscope.producers.tracers.python_sampler import PythonSampler
    program = tmp_path / "ranks.py"
    program.write_text(PROGRAM)
    procs = {}
    sampler = PythonSampler("node-a", resolver=IdentityResolver(host="node-a"), rate_hz=49, window_s=1)
    try:
        for rank, mode in MODES.items():
            env = {**os.environ, "RANK": str(rank), "FLEETSCOPE_JOB": "hangtest"}
            procs[rank] = subprocess.Popen([sys.executable, str(program), mode, str(tmp_path / f"ready{rank}")],
                                           env=env)
        deadline = time.monotonic() + 60
        for rank, p in procs.items():   # each in its function before it is sampled (start-up is not)
            while not (tmp_path / f"ready{rank}").exists():
                assert p.poll() is None and time.monotonic() < deadline, f"rank {rank} did not start"
                time.sleep(0.05)
            assert sampler.add_pid(p.pid)
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
    finally:
        for p in procs.values():
            p.kill()
            p.wait(timeout=10)
        sampler.close()
    ids = {}
    for w in assembler.pop_closed(force=True):
        assert w.key[1] == "hangtest"
        ids.setdefault(w.key[3], set()).add(top_frame_features(w).get(FEATURE))
    module = program.stem
    assert ids[0] == ids[2] == {frame_id(f"{module}:spin")}, ids
    assert ids[1] == {frame_id(f"{module}:stuck")}, ids
    assert ids[3] == {frame_id(f"{module}:blocked")}, ids
