"""Remediation: dry run by default, opt-in per entry AND per host, a log
record for every decision, and no real execution: every test injects a
RecordingExecutor except the LocalExecutor tests, which run only `echo`
and write only to a file under tmp_path."""
from __future__ import annotations

import pytest

from fleetscope.streams.diagnosis.kb import load_kb
from fleetscope.streams.diagnosis.remediation import ExecResult, LocalExecutor, Policy, plan, render, run_action


class RecordingExecutor:
    """Stands in for a host: records what would have run; runs nothing."""

    def __init__(self, host: str = "node-a", tools=("kubectl", "ps", "nvidia-smi", "migratepages", "numastat"),
                 result: ExecResult = ExecResult(0, "done\n")):
        self.host, self.tools, self.result = host, set(tools), result
        self.calls: list[tuple] = []

    def which(self, tool):
        return tool in self.tools

    def run(self, argv, timeout_s):
        self.calls.append(("run", tuple(argv)))
        return ExecResult(0, f"state of {argv[-1]}\n") if argv and argv[0] in ("ps", "cat", "numastat") else self.result

    def write(self, path, value):
        self.calls.append(("write", path, value))
        return self.result


@pytest.fixture(scope="module")
def kb():
    return load_kb()


def _plan(kb, name, host="node-a", **params):
    return plan(kb[name], tenant="acme", job="train-1", host=host, rank=3, window_start_ns=1_700_000_000_000_000_000,
                params=params, evidence={"cpu_busy_frac": 0.97})


ALLOW = Policy(execute=True, allowed_entries=frozenset({"cpu_contention_noisy_neighbour", "irq_locality_miss"}),
               allowed_hosts=frozenset({"node-a"}))


def test_dry_run_is_the_default_and_runs_nothing(kb, capsys):
    action = _plan(kb, "cpu_contention_noisy_neighbour")
    ex = RecordingExecutor()
    rec = run_action(action, Policy(), ex, clock=lambda: 5)
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
    rec = run_action(_plan(kb, "cpu_contention_noisy_neighbour"), policy, ex)
    assert ex.calls == []
    assert (rec.mode, rec.status) == ("refused", "refused") and why in rec.reason


def test_opted_in_action_runs_with_evidence_before_and_after(kb):
    ex = RecordingExecutor()
    rec = run_action(_plan(kb, "cpu_contention_noisy_neighbour"), ALLOW, ex, operator="alice", clock=lambda: 7)
    assert ex.calls == [("run", ("ps", "-eo", "pid,comm,pcpu", "--sort=-pcpu")),
                        ("run", ("kubectl", "cordon", "node-a")),
                        ("run", ("ps", "-eo", "pid,comm,pcpu", "--sort=-pcpu"))]
    assert (rec.mode, rec.status, rec.exit_code, rec.operator) == ("execute", "ok", 0, "alice")
    assert rec.evidence_before["check"].startswith("state of") and rec.evidence_after["check"].startswith("state of")
    assert rec.evidence_before["cpu_busy_frac"] == "0.97" and rec.stdout_head == "done\n"
    assert rec.record_id == f"{rec.action_id}-7"


def test_failed_command_is_logged_as_failed(kb):
    ex = RecordingExecutor(result=ExecResult(1, "", "node not found"))
    rec = run_action(_plan(kb, "cpu_contention_noisy_neighbour"), ALLOW, ex)
    assert (rec.status, rec.exit_code, rec.stderr_head) == ("failed", 1, "node not found")


def test_missing_tool_or_other_host_refuses(kb):
    ex = RecordingExecutor(tools=("ps",))
    rec = run_action(_plan(kb, "cpu_contention_noisy_neighbour"), ALLOW, ex)
    assert rec.status == "refused" and "kubectl" in rec.reason and ex.calls == []
    ex = RecordingExecutor(host="node-b")
    rec = run_action(_plan(kb, "cpu_contention_noisy_neighbour"), ALLOW, ex)
    assert rec.status == "refused" and "node-b" in rec.reason and ex.calls == []


def test_write_action_substitutes_each_token_safely(kb):
    action = _plan(kb, "irq_locality_miss", irq="142", cpus="0-3,8")
    assert (action.path, action.value, action.missing) == ("/proc/irq/142/smp_affinity_list", "0-3,8", ())
    ex = RecordingExecutor()
    rec = run_action(action, ALLOW, ex)
    assert ("write", "/proc/irq/142/smp_affinity_list", "0-3,8") in ex.calls and rec.status == "ok"


@pytest.mark.parametrize("params, flagged", [
    ({"cpus": "0-3"}, "irq"),                                        # not given
    ({"irq": "142; reboot", "cpus": "0-3"}, "irq (unsafe value"),    # shell characters
    ({"irq": "$(id)", "cpus": "0-3"}, "irq (unsafe value"),
    ({"irq": "../../etc", "cpus": "0"}, "must be a plain path"),     # path escape
    ({"irq": "1", "cpus": "--help"}, "cpus (unsafe value"),          # option injection
])
def test_missing_or_unsafe_parameters_block_execution(kb, params, flagged):
    action = _plan(kb, "irq_locality_miss", **params)
    assert any(flagged in m for m in action.missing), action.missing
    ex = RecordingExecutor()
    rec = run_action(action, ALLOW, ex)
    assert rec.status == "refused" and ex.calls == []
    dry = run_action(action, Policy(), ex)
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
        rec = run_action(action, Policy(), ex)
        assert rec.status == "planned" and rec.command
    assert ex.calls == []
    autos = [n for n, e in kb.items() if e.remediation.auto]
    assert len(autos) < len(kb) / 2, "most remediations must need an operator"
    assert all(kb[n].remediation.risk == "low" for n in autos), "only low-risk actions may run automatically"


def test_local_executor_uses_no_shell(tmp_path):
    ex = LocalExecutor()
    r = ex.run(("echo", "$(id)", ";", "x"), timeout_s=10)
    assert (r.exit_code, r.stdout) == (0, "$(id) ; x\n")
    assert ex.run(("/nonexistent/tool",), timeout_s=10).exit_code == 127
    target = tmp_path / "value"
    assert ex.write(str(target), "always").exit_code == 0 and target.read_text() == "always"
    assert ex.write(str(tmp_path / "missing" / "x"), "1").exit_code == 1
