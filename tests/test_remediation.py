"""Remediation: dry run by default, opt-in per entry AND per host, a log
record for every decision, and no real execution: every test injects a
RecordingExecutor except the LocalExecutor tests, which run only `echo`
and write only to a file under tmp_path."""
from __future__ import annotations

import argparse
import logging

import pytest

from fleetscope import config as config_mod
from fleetscope.streams.diagnosis.kb import load_kb
from fleetscope.streams.diagnosis.remediation import (ExecResult, IdentityOverride, LocalExecutor, Policy, plan,
                                                      render, run_action)
from support.recording_executor import RecordingExecutor


@pytest.fixture(scope="module")
def kb():
    return load_kb()


def _plan(kb, name, host="node-a", **params):
    return plan(kb[name], tenant="acme", job="train-1", host=host, rank=3, window_start_ns=1_700_000_000_000_000_000,
                params=params, evidence={"cpu_busy_frac": 0.97})


def unread(record) -> None:
    """A journal nobody reads: these tests check the returned record; the journal has tests of its own."""

ALLOW = Policy(execute=True, allowed_entries=frozenset({"cpu_contention_noisy_neighbour", "irq_locality_miss"}),
               allowed_hosts=frozenset({"node-a"}))


def test_dry_run_is_the_default_and_runs_nothing(kb, capsys):
    action = _plan(kb, "cpu_contention_noisy_neighbour")
    ex = RecordingExecutor()
    rec = run_action(action, Policy(), ex, clock=lambda: 5, journal=unread)
    assert ex.calls == []
    assert (rec.mode, rec.status, rec.exit_code) == ("dry_run", "planned", -1)
    assert rec.command == "kubectl cordon node-a"
    assert rec.evidence_before == {"cpu_busy_frac": "0.97"} and rec.evidence_after == {"dry_run": "nothing was executed"}
    text = render(action, rec)
    assert "would run: kubectl cordon node-a" in text and "risk medium" in text


@pytest.mark.parametrize("policy, why", [
    (Policy(execute=True, allowed_hosts=frozenset({"node-a"})), "entry cpu_contention_noisy_neighbour is not opted in"),
    (Policy(execute=True, allowed_entries=frozenset({"cpu_contention_noisy_neighbour"})), "host node-a is not opted in"),
    (Policy(execute=True, allowed_entries=frozenset({"straggler_rank"}), allowed_hosts=frozenset({"node-a"})),
     "not opted in"),
    (Policy(execute=True, allowed_entries=frozenset({"cpu_contention_noisy_neighbour"}),
            allowed_hosts=frozenset({"node-a"}), automatic=True), "auto: false"),
])
def test_execute_needs_entry_and_host_opt_in(kb, policy, why):
    ex = RecordingExecutor()
    rec = run_action(_plan(kb, "cpu_contention_noisy_neighbour"), policy, ex, journal=unread)
    assert ex.calls == []
    assert (rec.mode, rec.status) == ("refused", "refused") and why in rec.reason


def test_opted_in_action_runs_with_evidence_before_and_after(kb):
    ex = RecordingExecutor()
    rec = run_action(_plan(kb, "cpu_contention_noisy_neighbour"), ALLOW, ex, operator="alice", clock=lambda: 7,
                     journal=unread)
    assert ex.calls == [("run", ("ps", "-eo", "pid,comm,pcpu", "--sort=-pcpu")),
                        ("run", ("kubectl", "cordon", "node-a")),
                        ("run", ("ps", "-eo", "pid,comm,pcpu", "--sort=-pcpu"))]
    assert (rec.mode, rec.status, rec.exit_code, rec.operator) == ("execute", "ok", 0, "alice")
    assert rec.evidence_before["check"].startswith("state of") and rec.evidence_after["check"].startswith("state of")
    assert rec.evidence_before["cpu_busy_frac"] == "0.97" and rec.stdout_head == "done\n"
    assert rec.record_id == f"{rec.action_id}-7"


def test_failed_command_is_logged_as_failed(kb):
    ex = RecordingExecutor(result=ExecResult(1, "", "node not found"))
    rec = run_action(_plan(kb, "cpu_contention_noisy_neighbour"), ALLOW, ex, journal=unread)
    assert (rec.status, rec.exit_code, rec.stderr_head) == ("failed", 1, "node not found")


def test_missing_tool_or_other_host_refuses(kb):
    ex = RecordingExecutor(tools=("ps",))
    rec = run_action(_plan(kb, "cpu_contention_noisy_neighbour"), ALLOW, ex, journal=unread)
    assert rec.status == "refused" and "kubectl" in rec.reason and ex.calls == []
    ex = RecordingExecutor(host="node-b")
    rec = run_action(_plan(kb, "cpu_contention_noisy_neighbour"), ALLOW, ex, journal=unread)
    assert rec.status == "refused" and "node-b" in rec.reason and ex.calls == []


def test_write_action_substitutes_each_token_safely(kb):
    action = _plan(kb, "irq_locality_miss", irq="142", cpus="0-3,8")
    assert (action.path, action.value, action.missing) == ("/proc/irq/142/smp_affinity_list", "0-3,8", ())
    ex = RecordingExecutor()
    rec = run_action(action, ALLOW, ex, journal=unread)
    assert ("write", "/proc/irq/142/smp_affinity_list", "0-3,8") in ex.calls and rec.status == "ok"


@pytest.mark.parametrize("params, flagged", [
    ({"cpus": "0-3"}, "irq"),                                        # not given
    ({"irq": "142; reboot", "cpus": "0-3"}, "irq (unsafe value"),    # shell characters
    ({"irq": "$(id)", "cpus": "0-3"}, "irq (unsafe value"),
    ({"irq": "../../etc", "cpus": "0"}, "irq (unsafe value"),       # path escape: an irq is an integer
    ({"irq": "1", "cpus": "--help"}, "cpus (unsafe value"),          # option injection
])
def test_missing_or_unsafe_parameters_block_execution(kb, params, flagged):
    action = _plan(kb, "irq_locality_miss", **params)
    assert any(flagged in m for m in action.missing), action.missing
    ex = RecordingExecutor()
    rec = run_action(action, ALLOW, ex, journal=unread)
    assert rec.status == "refused" and ex.calls == []
    dry = run_action(action, Policy(), ex, journal=unread)
    assert dry.status == "planned" and ex.calls == []               # the dry run still shows the plan


def test_placeholder_value_stays_one_argv_token(kb):
    action = _plan(kb, "numa_misplacement", pid="4242", numa_node="1")
    assert action.argv == ("migratepages", "4242", "all", "1") and action.missing == ()
    host_with_space = plan(kb["cpu_contention_noisy_neighbour"], tenant="t", job="j", host="a b", rank=0)
    assert host_with_space.missing and "unsafe" in host_with_space.missing[0]


def test_every_shipped_entry_plans_and_dry_runs(kb):
    params = {"gpu": "0", "pid": "4242", "numa_node": "1", "irq": "142", "cpus": "0-3"}
    ex = RecordingExecutor()
    for name, entry in kb.items():
        action = _plan(kb, name, **params)
        assert action.missing == (), (name, action.missing)
        rec = run_action(action, Policy(), ex, journal=unread)
        assert rec.status == "planned" and rec.command
    assert ex.calls == []
    autos = [n for n, e in kb.items() if e.remediation.auto]
    assert len(autos) < len(kb) / 2, "most remediations must need an operator"
    everyone = [e.remediation for e in kb.values()] + [b.remediation for e in kb.values() for b in e.alternatives
                                                       if b.remediation is not None]
    assert all(r.risk == "low" for r in everyone if r.auto), "only low-risk actions may run automatically"


def test_a_slow_tcp_link_named_by_its_wakeups_gets_its_sockets_read_not_nvlinks_counters(kb):
    """slow_degraded_link's `or` block (the rank behind a slow link in a ring, named by how often it wakes) is a
    TCP link: its plan reads the host's sockets; the main block (one rank's bandwidth and tail latency against its
    peers', as NVLink shows) keeps the NVLink counters."""
    entry = kb["slow_degraded_link"]
    ring = ("link_wakeup_ratio >= 1.2", "job_iteration_time_ratio >= 1.1")
    action = plan(entry, tenant="acme", job="train-1", host="node-a", rank=2, held=ring)
    assert action.argv == ("ss", "-tin", "state", "established") and action.missing == ()
    assert action.check[0] == "nstat" and action.auto and action.risk == "low"
    one_rank = ("peer_z.nccl_lat_p99_ns >= 2", "peer_z.nccl_algbw_gbps <= -3")
    assert plan(entry, tenant="acme", job="train-1", host="node-a", rank=2, held=one_rank,
                params={"gpu": "0"}).argv[:3] == ("nvidia-smi", "nvlink", "-e")


def test_local_executor_uses_no_shell(tmp_path):
    ex = LocalExecutor()
    r = ex.run(("echo", "$(id)", ";", "x"), timeout_s=10)
    assert (r.exit_code, r.stdout) == (0, "$(id) ; x\n")
    assert ex.run(("/nonexistent/tool",), timeout_s=10).exit_code == 127
    target = tmp_path / "value"
    assert ex.write(str(target), "always").exit_code == 0 and target.read_text() == "always"
    assert ex.write(str(tmp_path / "missing" / "x"), "1").exit_code == 1


# ---- issue 13: identity cannot be overridden, intent before action, values by shape ------

@pytest.mark.parametrize("name, value", [("host", "node-b"), ("tenant", "other"), ("job", "other-job"), ("rank", "0")])
def test_params_cannot_override_identity(kb, name, value):
    # Before the fix, --param host=node-b under --allow-host node-a ran `kubectl cordon node-b`.
    with pytest.raises(IdentityOverride, match=f"--param {name} refused"):
        plan(kb["cpu_contention_noisy_neighbour"], tenant="acme", job="train-1", host="node-a", rank=3,
             params={name: value})


def test_cli_refuses_an_identity_param_before_touching_anything(tmp_path, capsys):
    from fleetscope.cli.kb import cmd_remediate, register
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["remediate", "--job", "train-1", "--execute", "--allow-entry",
                              "cpu_contention_noisy_neighbour", "--allow-host", "node-a", "--param", "host=node-b"])
    ex = RecordingExecutor(host="node-b")
    cfg = config_mod.load(env={}, data_dir=tmp_path, host="node-b")
    assert cmd_remediate(args, cfg, executor=ex) == 2
    assert ex.calls == [] and "--param host refused" in capsys.readouterr().err
    assert not (tmp_path / "chdb").exists()  # refused before the store was even opened


class Timeline:
    """One ordered list of what the journal got and what the executor was asked to do."""

    def __init__(self):
        self.events: list[tuple] = []

    def journal(self, record) -> None:
        self.events.append(("journal", record.mode, record.status))


def test_intent_is_journaled_and_logged_before_anything_runs(kb, caplog):
    timeline = Timeline()
    ex = RecordingExecutor()
    ex.calls = timeline.events  # executor calls land in the same ordered list
    with caplog.at_level(logging.INFO, logger="fleetscope.streams.diagnosis.remediation"):
        rec = run_action(_plan(kb, "cpu_contention_noisy_neighbour"), ALLOW, ex, journal=timeline.journal)
    assert timeline.events == [("journal", "execute", "started"),
                               ("run", ("ps", "-eo", "pid,comm,pcpu", "--sort=-pcpu")),
                               ("run", ("kubectl", "cordon", "node-a")),
                               ("run", ("ps", "-eo", "pid,comm,pcpu", "--sort=-pcpu")),
                               ("journal", "execute", "ok")]
    assert rec.status == "ok"
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith("remediation starting: cpu_contention_noisy_neighbour on node-a rank 3")
    assert "kubectl cordon node-a" in messages[0] and messages[-1].startswith("remediation ok:")


def test_nothing_runs_when_the_intent_cannot_be_recorded(kb):
    ex = RecordingExecutor()

    def broken_journal(record):
        raise OSError("remediation_log unreachable")

    with pytest.raises(OSError, match="unreachable"):
        run_action(_plan(kb, "cpu_contention_noisy_neighbour"), ALLOW, ex, journal=broken_journal)
    assert ex.calls == []


def test_dry_runs_and_refusals_are_journaled_once(kb):
    timeline = Timeline()
    ex = RecordingExecutor()
    run_action(_plan(kb, "cpu_contention_noisy_neighbour"), Policy(), ex, journal=timeline.journal)
    run_action(_plan(kb, "cpu_contention_noisy_neighbour", host="node-z"), ALLOW, ex, journal=timeline.journal)
    assert timeline.events == [("journal", "dry_run", "planned"), ("journal", "refused", "refused")]


@pytest.mark.parametrize("entry, params, flagged", [
    ("numa_misplacement", {"pid": "12/34", "numa_node": "1"}, "pid (unsafe value '12/34': must be a non-negative integer"),
    ("numa_misplacement", {"pid": "4242", "numa_node": "node1"}, "numa_node (unsafe value"),
    ("numa_misplacement", {"pid": "-1", "numa_node": "1"}, "pid (unsafe value"),
    ("irq_locality_miss", {"irq": "142", "cpus": "0-3/../x"}, "cpus (unsafe value '0-3/../x': must be a CPU list"),
    ("irq_locality_miss", {"irq": "142", "cpus": "0-3,a"}, "cpus (unsafe value"),
    ("irq_locality_miss", {"irq": "1e3", "cpus": "0"}, "irq (unsafe value"),
    ("gpu_memory_leak", {"gpu": "0/1"}, "gpu (unsafe value"),
    ("gpu_memory_leak", {"gpu": "GPU-abc"}, "gpu (unsafe value"),
    ("gpu_memory_leak", {"gpu": "0 --help"}, "gpu (unsafe value"),
])
def test_values_are_checked_by_the_shape_of_their_kind(kb, entry, params, flagged):
    action = _plan(kb, entry, **params)
    assert any(m.startswith(flagged) for m in action.missing), action.missing
    ex = RecordingExecutor()
    assert run_action(action, ALLOW, ex, journal=unread).status == "refused" and ex.calls == []


@pytest.mark.parametrize("entry, params, argv_or_path", [
    ("gpu_memory_leak", {"gpu": "GPU-12345678-1234-1234-1234-123456789abc"}, "GPU-12345678-1234-1234-1234-123456789abc"),
    ("gpu_memory_leak", {"gpu": "00000000:3B:00.0"}, "00000000:3B:00.0"),
    ("irq_locality_miss", {"irq": "7", "cpus": "0-3,5,8-11"}, "/proc/irq/7/smp_affinity_list"),
])
def test_well_shaped_values_pass(kb, entry, params, argv_or_path):
    action = _plan(kb, entry, **params)
    assert action.missing == () and (argv_or_path in action.argv or action.path == argv_or_path)


def test_a_host_name_with_a_slash_from_the_diagnosis_is_refused(kb):
    action = plan(kb["cpu_contention_noisy_neighbour"], tenant="t", job="j", host="node-a/../b", rank=0)
    assert any(m.startswith("host (unsafe value") for m in action.missing)
