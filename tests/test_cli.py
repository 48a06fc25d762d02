"""The commands as a user runs them: `fleetscope up`, `query` from another terminal, `db migrate`."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

CLI = [sys.executable, "-m", "fleetscope"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_up_shows_live_windows_serves_queries_and_ctrl_c_leaves_nothing_running(tmp_path):
    env = {**os.environ, "FLEETSCOPE_DATA_DIR": str(tmp_path), "FLEETSCOPE_TOPIC_PREFIX": "cli"}
    env.pop("FLEETSCOPE_KAFKA", None)
    # started as `cmd &` from a script starts it: SIGINT inherited ignored, which `up` must override to keep
    # its "Ctrl-C stops everything" (it did not, and this test hung beside busy loops started that way)
    up = subprocess.Popen(CLI + ["up", "--plain"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    lines: list[tuple[float, str]] = []
    start = time.monotonic()
    reader = threading.Thread(target=lambda: [lines.append((time.monotonic() - start, l)) for l in up.stdout])
    reader.start()
    try:
        deadline = start + 120
        first_window_at = None
        while time.monotonic() < deadline and first_window_at is None:
            for t, line in list(lines):
                m = re.search(r"([\d,]+) windows out", line)
                if m and int(m.group(1).replace(",", "")) > 0:
                    first_window_at = t
            time.sleep(0.2)
        # how fast the first window comes is a speed goal, not a test's business (no timing assertions)
        assert first_window_at is not None, "".join(l for _, l in lines)
        banner = next(l for _, l in lines if l.startswith("fleetscope up:"))
        broker_pid = int(re.search(r"embedded, pid (\d+)", banner).group(1))
        sink_pid = int(re.search(r"sink pid (\d+)", banner).group(1))
        streams_pid = int(re.search(r"streams worker pid (\d+)", banner).group(1))

        # another terminal: chDB is held by the sink, so this must go through its endpoint
        q = subprocess.run(CLI + ["query", "SELECT count() AS n FROM features WHERE job = {h:String}",
                                  "--param", f"h={os.uname().nodename}", "--format", "tsv"],
                           env=env, capture_output=True, text=True, timeout=60)
        assert q.returncode == 0, q.stderr
        assert q.stdout.splitlines()[0] == "n" and int(q.stdout.splitlines()[1]) >= 1
    finally:
        up.send_signal(signal.SIGINT)  # Ctrl-C
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:  # fail, but leave nothing running for the next tests
            up.kill()
            up.wait()
            raise
        reader.join(5)
    assert up.returncode == 0, "".join(l for _, l in lines)[-3000:]
    for pid in (broker_pid, sink_pid, streams_pid):
        assert not alive(pid), f"pid {pid} still running after Ctrl-C"
    assert not (tmp_path / "endpoint.json").exists()


def test_query_with_no_running_stack_opens_the_store_directly(tmp_path):
    env = {**os.environ, "FLEETSCOPE_DATA_DIR": str(tmp_path)}
    m = subprocess.run(CLI + ["db", "migrate"], env=env, capture_output=True, text=True, timeout=120)
    assert m.returncode == 0 and "applied" in m.stdout, m.stderr
    again = subprocess.run(CLI + ["db", "migrate"], env=env, capture_output=True, text=True, timeout=120)
    assert "up to date" in again.stdout
    q = subprocess.run(CLI + ["query", "SELECT count() FROM dlq", "--format", "json"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert q.returncode == 0 and '"count()": 0' in q.stdout, q.stderr


def test_bad_sql_is_a_clear_error_not_a_traceback(tmp_path):
    env = {**os.environ, "FLEETSCOPE_DATA_DIR": str(tmp_path)}
    q = subprocess.run(CLI + ["query", "SELEC nonsense"], env=env, capture_output=True, text=True, timeout=120)
    assert q.returncode == 1
    assert "query failed" in q.stderr and "Traceback" not in q.stderr


def test_agent_without_kafka_explains_what_to_do(tmp_path):
    env = {**os.environ, "FLEETSCOPE_DATA_DIR": str(tmp_path)}
    env.pop("FLEETSCOPE_KAFKA", None)
    r = subprocess.run(CLI + ["agent"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "FLEETSCOPE_KAFKA" in r.stderr and "fleetscope up" in r.stderr


def test_up_with_a_configured_kafka_starts_no_broker(tmp_path, broker):
    env = {**os.environ, "FLEETSCOPE_DATA_DIR": str(tmp_path), "FLEETSCOPE_KAFKA": broker.bootstrap,
           "FLEETSCOPE_TOPIC_PREFIX": f"ext{time.time_ns()}", "FLEETSCOPE_CONSUMER_GROUP": f"ext{time.time_ns()}"}
    log = tmp_path / "up.log"
    with open(log, "wb") as sink:
        up = subprocess.Popen(CLI + ["up", "--plain", "--duration", "3"], env=env, stdout=sink, stderr=subprocess.STDOUT)
    started = set()
    while up.poll() is None:  # watch only this `up`'s own descendants: other runs on the machine may start brokers
        started |= tansu_descendants(up.pid)
        time.sleep(0.1)
    out = log.read_text()
    assert up.returncode == 0, out
    assert f"broker {broker.bootstrap}," in out and "embedded" not in out.splitlines()[0]
    assert started == set(), f"`up` with a configured Kafka started an embedded broker: pids {started}"


def tansu_descendants(root: int) -> set[int]:
    """Pids of tansu processes below `root`, from /proc's parent links."""
    parents, commands = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
                commands[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[0]
            except (OSError, ValueError, IndexError):
                continue
    found = set()
    for pid, cmd in commands.items():
        ancestor = parents.get(pid)
        while ancestor and ancestor != root:
            ancestor = parents.get(ancestor)
        if ancestor == root and b"tansu" in cmd:
            found.add(pid)
    return found


def test_a_native_crash_in_any_command_prints_every_threads_python_stack():
    """Every command's process (up, agent, streams, sink: all go through main) reports a crash in native code
    with the Python stack of each thread, not only an exit status -11 (a real segfault: a read at address 0)."""
    crash = ("import ctypes, faulthandler, threading\n"
             "from fleetscope.cli.main import main\n"
             "assert main(['kb', 'list']) == 0 and faulthandler.is_enabled()\n"
             "def read_address_zero():\n"
             "    ctypes.string_at(0)\n"
             "threading.Thread(target=lambda: __import__('time').sleep(60), name='bystander', daemon=True).start()\n"
             "read_address_zero()\n")
    out = subprocess.run([sys.executable, "-c", crash], capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGSEGV, (out.returncode, out.stderr[-2000:])
    assert "Segmentation fault" in out.stderr and "read_address_zero" in out.stderr, out.stderr[-2000:]
    assert out.stderr.count("hread 0x") >= 2, out.stderr[-2000:]   # the bystander's stack too


def test_installed_console_script_works_from_any_directory(tmp_path):
    """`make up` runs the venv's `fleetscope` script: every subcommand must import without the repo as cwd."""
    script = Path(sys.executable).with_name("fleetscope")
    assert script.exists(), f"{script} missing: run install.sh"
    out = subprocess.run([str(script), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for command in ("up", "agent", "streams", "query", "kb", "diagnose", "remediate", "bench", "demo"):
        assert command in out.stdout
    out = subprocess.run([str(script), "kb", "list"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "straggler_rank" in out.stdout, out.stderr
