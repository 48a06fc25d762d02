"""One short fault scenario end to end: the real embedded stack (tansu, a streams worker
process with chDB, the agent with real eBPF tracers), three real DDP ranks under torchrun,
and a real CPU quota on one rank. It must be detected on that rank, and nothing may be left
behind (fault cgroup, workload, stack). Short windows and warm-up keep it short (its speed is not
asserted here: a loaded machine slows it)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fleetscope.eval.cgroups import PARENT, CgroupUnavailable, controller_root

# Strength 0.95 caps rank 2 at 0.05 CPU. The earlier 0.85 (0.15 CPU) was near what a rank of this workload uses
# on a loaded 2-core machine: measured beside one busy loop per core, its impact was -1.8%, -15% and -23% in three
# runs, so the fault at times had no measured effect and nothing could be detected. At 0.95: -61%, -71%, -75%.
SCENARIO = """
name: ci_straggler
description: a short straggler for CI
workload: ddp_cpu
ranks: 3
duration_s: 16
window_s: 0.5
requires: [root, cgroup_cpu]
fault:
  kind: cpu_quota
  rank: 2
  start_s: 4
  duration_s: 8
  strength: 0.95
  params: {cpus: 1, period_us: 100000}
expect:
  kb_entry: straggler_rank
  ranks: [2]
"""


def _cpu_cgroup_ok() -> bool:
    try:
        controller_root("cpu")
        return True
    except CgroupUnavailable:
        return False


def _our_processes(job: str) -> list[int]:
    """Processes still carrying this run's job id (torchrun's rdzv id) in their environment."""
    from fleetscope.eval.workloads.launch import environ_of
    left = []
    for d in os.listdir("/proc"):
        if d.isdigit() and environ_of(int(d)).get("TORCHELASTIC_RUN_ID") == job:
            left.append(int(d))
    return left


needs_root_and_cgroups = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: eBPF tracing and a cgroup CPU quota"),
    pytest.mark.skipif(not _cpu_cgroup_ok(), reason="no cgroup hierarchy with the cpu controller"),
]


@pytest.fixture(scope="module")
def straggler_run(tmp_path_factory):
    """The scenario, run once for both tests below."""
    from fleetscope.cli.bench import run_in_child
    tmp_path = tmp_path_factory.mktemp("ci_straggler")
    path = tmp_path / "ci_straggler.yaml"
    path.write_text(SCENARIO)
    # 40 windows (20 s): every source (proc, gloo waits; torch attaches only once a rank has imported it, slow
    # under load) is usable well before the thresholds calibrate on the
    # second half; a feature that joins the score after calibration lifts every NLL (see the closing note)
    opts = {"out_dir": str(tmp_path / "out"), "warmup_windows": 40, "work_dir": str(tmp_path / "work")}
    result = run_in_child(path, opts, tmp_path / "run.log")
    return tmp_path, result


@needs_root_and_cgroups[0]
@needs_root_and_cgroups[1]
def test_a_short_straggler_scenario_runs_end_to_end_and_leaves_nothing_behind(straggler_run):
    """The harness itself: the fault is injected on time and measurably slows the job, the run is scored and
    plotted, and no process, endpoint or cgroup is left behind."""
    tmp_path, result = straggler_run
    assert "skipped" not in result, result
    assert result["faults"][0]["injected"][0]["on_s"] == pytest.approx(4.0, abs=1.0)
    impact = result["faults"][0]["impact"]
    assert impact["effect"] and impact["impact_pct"] < 0, result["faults"][0]  # the quota measurably slowed the job
    assert Path(result["plot"]).stat().st_size > 10_000
    # the clock started at least 10 windows after the tracers reached the last rank (runner.wait_traced)
    assert result["traced_before_t0_s"] is not None and result["traced_before_t0_s"] >= 10 * 0.5, result
    # nothing left behind: the rank processes, the stack's data dir holds no live endpoint, the cgroup is gone
    assert _our_processes(result["job"]) == []
    from fleetscope.store import endpoint_alive
    assert not endpoint_alive(tmp_path / "work" / result["job"]), "the stack still serves its store"
    root, version = controller_root("cpu")
    assert not list(root.rglob(f"{PARENT}/cpu-quota-*")), "the fault's cgroup was not removed"


@needs_root_and_cgroups[0]
@needs_root_and_cgroups[1]
def test_the_short_straggler_is_detected_on_its_rank(straggler_run):
    """The detection half: the throttled rank is flagged within 3 s, most of its fault windows are flagged, and most
    flags are on it."""
    tmp_path, result = straggler_run
    s = result["score"]
    assert s["detection_delay_windows"] is not None, (f"the straggler was never flagged: {json.dumps(s)}\n"
                                                     f"{(tmp_path / 'run.log').read_text()[-3000:]}")
    assert s["detection_delay_windows"] <= 6, s  # within 3 s of the quota starting
    assert s["recall"] >= 0.5 and s["precision"] >= 0.5, s
    # the rules compared on the run: one whose detectors this worker did not run says so, with no recall
    rules = result["rules"]
    assert "f1" in rules["gmm or peer"] and set(rules["hst"]) == {"not_run"}, rules


@needs_root_and_cgroups[0]
@needs_root_and_cgroups[1]
def test_a_scenario_stopped_by_repeated_signals_to_its_process_group_still_undoes_its_fault(tmp_path):
    """`timeout`, a CI job's cancel and `kill -- -PGID` signal the whole group: `fleetscope bench scenario`, its
    `run_one` child, torchrun and the ranks. The parent forwards one more SIGTERM, and an impatient user sends
    another. Every signal after the first must leave the cleanup alone: before, one that came while the quota
    was being undone cut the cleanup short and left the three ranks running with rank 2 still in its cgroup (1 of
    3 runs with a single group signal; here more follow, every 50 ms for 2 s, so the old code fails every time)."""
    import signal
    import subprocess
    import sys
    import time
    path = tmp_path / "ci_straggler.yaml"
    path.write_text(SCENARIO.replace("duration_s: 16", "duration_s: 60", 1))
    out_file = tmp_path / "bench.out"
    with open(out_file, "w") as out:
        bench = subprocess.Popen([sys.executable, "-m", "fleetscope", "bench", "scenario", str(path), "--repeats", "1",
                                  "--warmup-windows", "20", "--work-dir", str(tmp_path / "work"),
                                  "--out", str(tmp_path / "out")],
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "fault 0 ON" not in out_file.read_text():
            assert bench.poll() is None and time.monotonic() < deadline, out_file.read_text()[-3000:]
            time.sleep(0.5)
        job = out_file.read_text().split("running as job ", 1)[1].split(":", 1)[0]
        assert _our_processes(job), "the ranks should be running while the fault is on"
        for _ in range(40):  # the group's signal, then more while the cleanup runs: its first steps take milliseconds
            os.killpg(bench.pid, signal.SIGTERM)
            time.sleep(0.05)
        bench.wait(150)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
    text = out_file.read_text()
    left, root = _our_processes(job), controller_root("cpu")[0]
    quota_cgroups = list(root.rglob(f"{PARENT}/cpu-quota-*"))
    for pid in left:  # leave no busy ranks behind even when the test fails
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    for cg in quota_cgroups:
        cg.rmdir()
    assert "interrupted" in text, text[-3000:]
    assert left == [], f"ranks left running:\n{text[-3000:]}"
    assert quota_cgroups == [], "the fault's cgroup was not removed"
    from fleetscope.store import endpoint_alive
    assert not endpoint_alive(tmp_path / "work" / job), "the stack still serves its store"


RUN_ONE_HANDLER = """
import os, signal, sys, time
from fleetscope.eval import run_one
signal.signal(signal.SIGTERM, run_one._interrupt)
signal.signal(signal.SIGINT, run_one._interrupt)
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    sys.exit("the first SIGTERM raised nothing")
except KeyboardInterrupt:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM):  # the cleanup: more signals arrive
        os.kill(os.getpid(), sig)
        time.sleep(0.05)
    print("cleanup finished")
"""


def test_a_scenario_run_stops_on_its_first_signal_and_ignores_the_ones_after_it_while_it_cleans_up():
    """The mechanism of the test above, without a scenario: `run_one`'s handler turns the first SIGTERM into
    KeyboardInterrupt (the cleanup starts) and later SIGTERMs and SIGINTs, real signals to a real process,
    no longer raise."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", RUN_ONE_HANDLER], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "cleanup finished" in r.stdout, r.stdout + r.stderr
