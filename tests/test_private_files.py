"""What the stack writes under its data directory is private, whatever the caller's umask (issue 13, 3).

The audit found 0755 directories and 0644 files under umask 022. The store and the endpoint are covered
in test_query_door.py; these are the other writers: `fleetscope up`'s child processes and their logs (the
launcher's ChildProcess, here with a real child that creates a file of its own) and the agent's on-disk spool.
"""
import os
import stat
import sys

import pytest

from fleetscope.cli.launcher import ChildProcess
from fleetscope.producers.spool import DiskSpool, Pending


@pytest.fixture
def loose_umask():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _open_to_others(root):
    return [f"{oct(stat.S_IMODE(p.stat().st_mode))} {p.relative_to(root)}" for p in [root, *root.rglob("*")]
            if stat.S_IMODE(p.stat().st_mode) & 0o077]


def test_a_stack_child_its_log_and_what_it_creates_are_private(tmp_path, loose_umask):
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    (data / "sink.log").write_bytes(b"from an older version\n")
    os.chmod(data / "sink.log", 0o644)
    code = "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text('x'); print('made it')"
    child = ChildProcess("sink", [sys.executable, "-c", code, str(data / "made-by-child")], dict(os.environ),
                         data / "sink.log").start()
    assert child.proc.wait(timeout=30) == 0
    assert (data / "sink.log").read_text().endswith("made it\n")
    os.chmod(data, 0o700)  # the launcher's own (private_dir); only the files are the question here
    assert _open_to_others(data) == []


def test_the_launcher_makes_an_existing_data_directory_private(tmp_path, loose_umask):
    from fleetscope.private_files import private_dir
    (tmp_path / "data").mkdir(mode=0o755)
    private_dir(tmp_path / "data")
    assert stat.S_IMODE((tmp_path / "data").stat().st_mode) == 0o700


def test_the_on_disk_spool_is_private(tmp_path, loose_umask):
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir(mode=0o755)
    spool = DiskSpool(spool_dir, max_bytes=1 << 20)
    value = b"batch bytes"
    spool.write(Pending(order=(1,), topic="fleetscope.raw.host", key=b"k", headers=[("fs-schema", b"1")],
                        count=1, size=len(value), value=value))
    assert [p.name for p in spool_dir.iterdir()]
    assert _open_to_others(spool_dir) == []
