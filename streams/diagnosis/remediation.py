"""Plan and (only when opted in) run a KB entry's remediation.

Safety rules, all enforced here:
- The default is a dry run: it says what it would run and runs nothing, not
  even the read-only check.
- Executing needs Policy(execute=True) AND the entry in allowed_entries AND
  the host in allowed_hosts. A trigger without an operator (automatic=True)
  also needs the entry's `auto: true`.
- Commands never pass through a shell: the KB's command is split once at load
  time, and each {placeholder} is filled inside its own argv token. A value
  must match the shape of its parameter kind (PARAM_SHAPES: a host name, an
  integer, a CPU list like 0-3,5, a GPU index or UUID; any other placeholder
  is a plain name), so no slash, space, quote or shell character gets in, and
  no leading '-' can smuggle in an option.
- The identity values (tenant, job, host, rank) come from the diagnosis only:
  an operator's params may not override them (IdentityOverride), so
  `--param host=node-b` cannot retarget an action allowed for node-a.
- A `write` goes only to a path under /sys/ or /proc/ without '..'.
- Every decision (dry run, refusal, run) yields a LogRecord with evidence from
  before and after, for the remediation_log table. Before anything runs on the
  machine (the evidence check included), a "started" record goes to the
  journal and the Python log; if the journal cannot take it, nothing runs.
  The outcome follows as a second record.
- The executor is injected: tests pass a recording one; LocalExecutor is the
  only thing that touches the machine, and it acts only on its own host.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shlex
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence

from fleetscope.streams.diagnosis.kb import PLACEHOLDER_RE, Entry

OUTPUT_HEAD = 4000  # characters of stdout/stderr kept in the log
log = logging.getLogger(__name__)

# Identity values come from the diagnosis; an operator may not override them.
IDENTITY_PARAMS = ("tenant", "job", "host", "rank")

# What each parameter kind may look like. None allows '/', a space, a quote or a
# shell character, and none may start with '-'.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@+=-]{0,127}$")
HOST_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,251}[A-Za-z0-9])?$")
INTEGER = re.compile(r"^(?:0|[1-9][0-9]{0,9})$")
CPU_LIST = re.compile(r"^[0-9]{1,5}(?:-[0-9]{1,5})?(?:,[0-9]{1,5}(?:-[0-9]{1,5})?)*$")
GPU_ID = re.compile(r"^(?:[0-9]{1,3}|GPU-[0-9A-Fa-f]{8}(?:-[0-9A-Fa-f]{4}){3}-[0-9A-Fa-f]{12}"
                    r"|[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])$")
PARAM_SHAPES: dict[str, re.Pattern] = {
    "tenant": NAME, "job": NAME, "host": HOST_NAME, "rank": INTEGER,
    "pid": INTEGER, "irq": INTEGER, "numa_node": INTEGER, "gpu": GPU_ID, "cpus": CPU_LIST,
}
SHAPE_NAMES = {NAME: "a name", HOST_NAME: "a host name", INTEGER: "a non-negative integer",
               CPU_LIST: "a CPU list like 0-3,5", GPU_ID: "a GPU index, UUID or PCI bus id"}


class RemediationError(ValueError):
    pass


class IdentityOverride(RemediationError):
    """An operator's params tried to set an identity value."""


def check_operator_params(params: Mapping[str, str]) -> None:
    """Refuse params that name an identity value; they come from the diagnosis."""
    taken = [name for name in IDENTITY_PARAMS if name in params]
    if taken:
        raise IdentityOverride(
            f"--param {', '.join(taken)} refused: tenant, job, host and rank come from the diagnosis, "
            f"not from --param (choose hosts with --allow-host, ranks with --rank)")


def shape_of(name: str) -> re.Pattern:
    return PARAM_SHAPES.get(name, NAME)


def unsafe_reason(name: str, value: str) -> str | None:
    """Why value cannot fill placeholder `name`, or None when it fits the shape."""
    shape = shape_of(name)
    if shape.match(value):
        return None
    return f"{name} (unsafe value {value!r}: must be {SHAPE_NAMES[shape]})"


@dataclass(frozen=True)
class Action:
    entry: str
    tenant: str
    job: str
    host: str
    rank: int
    window_start_ns: int
    kind: str                        # "command" | "write"
    argv: tuple[str, ...] = ()
    path: str = ""
    value: str = ""
    check: tuple[str, ...] = ()
    risk: str = "low"
    auto: bool = False
    requires: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()    # placeholders with no (valid) value
    evidence: Mapping[str, float] = field(default_factory=dict)

    @property
    def action_id(self) -> str:
        key = "\x1f".join([self.tenant, self.job, self.host, str(self.rank), str(self.window_start_ns),
                           self.entry, self.describe()])
        return hashlib.sha1(key.encode()).hexdigest()[:16]

    def describe(self) -> str:
        if self.kind == "write":
            return f"write {self.value!r} to {self.path}"
        return shlex.join(self.argv)


@dataclass(frozen=True)
class Policy:
    execute: bool = False
    allowed_entries: frozenset[str] = frozenset()
    allowed_hosts: frozenset[str] = frozenset()
    automatic: bool = False          # no operator in the loop (the stream worker)

    def decide(self, action: Action) -> tuple[str, str]:
        """(mode, reason): mode is "dry_run", "refused" or "execute"."""
        if not self.execute:
            return "dry_run", "dry run (the default): nothing was executed"
        if action.entry not in self.allowed_entries:
            return "refused", f"entry {action.entry} is not opted in (allow it explicitly)"
        if action.host not in self.allowed_hosts:
            return "refused", f"host {action.host} is not opted in (allow it explicitly)"
        if self.automatic and not action.auto:
            return "refused", f"entry {action.entry} has auto: false; it runs only when an operator asks"
        if action.missing:
            return "refused", f"missing or unsafe parameters: {', '.join(action.missing)}"
        return "execute", "opted in for this entry and host"


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: str = ""
    stderr: str = ""


class Executor(Protocol):
    host: str

    def which(self, tool: str) -> bool: ...

    def run(self, argv: tuple[str, ...], timeout_s: float) -> ExecResult: ...

    def write(self, path: str, value: str) -> ExecResult: ...


class LocalExecutor:
    """Runs on this machine only: argv without a shell; writes to one file."""

    def __init__(self, host: str | None = None) -> None:
        self.host = host or socket.gethostname()

    def which(self, tool: str) -> bool:
        return shutil.which(tool) is not None

    def run(self, argv: tuple[str, ...], timeout_s: float) -> ExecResult:
        try:
            p = subprocess.run(list(argv), shell=False, stdin=subprocess.DEVNULL, capture_output=True,
                               text=True, timeout=timeout_s)
        except FileNotFoundError:
            return ExecResult(127, "", f"{argv[0]}: not found")
        except subprocess.TimeoutExpired:
            return ExecResult(124, "", f"timed out after {timeout_s:g} s")
        return ExecResult(p.returncode, p.stdout, p.stderr)

    def write(self, path: str, value: str) -> ExecResult:
        try:
            with open(path, "w", encoding="ascii") as f:
                f.write(value)
        except OSError as exc:
            return ExecResult(1, "", f"{path}: {exc}")
        return ExecResult(0)


@dataclass(frozen=True)
class LogRecord:
    ts_ns: int
    action_id: str
    tenant: str
    job: str
    host: str
    rank: int
    window_start_ns: int
    kb_entry: str
    mode: str           # "dry_run" | "refused" | "execute"
    status: str         # "planned" | "refused" | "started" (intent, before acting) | "ok" | "failed"
    command: str
    reason: str
    risk: str
    exit_code: int      # -1 when nothing ran
    stdout_head: str
    stderr_head: str
    evidence_before: dict[str, str]
    evidence_after: dict[str, str]
    operator: str

    @property
    def record_id(self) -> str:
        return f"{self.action_id}-{self.ts_ns}"


def plan(entry: Entry, *, tenant: str, job: str, host: str, rank: int, window_start_ns: int = 0,
         params: Mapping[str, str] | None = None, evidence: Mapping[str, float] | None = None,
         held: Sequence[str] = ()) -> Action:
    """Fill the entry's command with the anomaly's identity and the operator's params. ``held``: the diagnosis's
    held rules, which say which of the entry's rule blocks matched and so whose remediation applies.

    Raises IdentityOverride when params name tenant, job, host or rank."""
    check_operator_params(params or {})
    values = {**dict(params or {}), "tenant": tenant, "job": job, "host": host, "rank": str(rank)}
    rem = entry.remediation_for(held)
    missing: set[str] = set()
    fill = _filler(values, missing)
    argv = tuple(fill(t) for t in rem.argv)
    check = tuple(fill(t) for t in rem.check)
    path, value = fill(rem.write_path), fill(rem.write_value)
    if rem.kind == "write" and not missing:
        norm = os.path.normpath(path)
        if norm != path or ".." in path.split("/") or not norm.startswith(("/sys/", "/proc/")):
            missing.add(f"path {path!r} (must be a plain path under /sys/ or /proc/)")
    return Action(entry.name, tenant, job, host, int(rank), int(window_start_ns), rem.kind, argv, path, value,
                  check, rem.risk, rem.auto, rem.requires, tuple(sorted(missing)), dict(evidence or {}))


def run_action(action: Action, policy: Policy, executor: Executor, *, journal: Callable[[LogRecord], None],
               operator: str = "", timeout_s: float = 30.0, clock: Callable[[], int] = time.time_ns) -> LogRecord:
    """Decide, then (only in execute mode) check, act and check again; journal every record.

    `journal` receives each record as it is made (the CLI writes it to
    remediation_log at once). In execute mode the first record, status
    "started", is journaled before the executor is touched: if journaling
    raises, nothing runs. The returned record is the outcome, journaled too."""
    mode, reason = policy.decide(action)
    before = {k: repr(v) for k, v in action.evidence.items()}
    after: dict[str, str] = {}
    result: ExecResult | None = None
    if mode == "execute" and executor.host != action.host:
        mode, reason = "refused", f"executor runs on {executor.host}, the action targets {action.host}"
    if mode == "execute":
        absent = [t for t in action.requires if not executor.which(t)]
        if absent:
            mode, reason = "refused", f"required tools missing on {action.host}: {', '.join(absent)}"
    if mode == "execute":
        intent = _record(action, clock, "execute", "started", "about to run; the outcome follows in its own record",
                         None, before, {}, operator)
        log.warning("remediation starting: %s on %s rank %d: %s (operator %s)", action.entry, action.host,
                    action.rank, action.describe(), operator or "-")
        journal(intent)  # raises if the intent cannot be recorded: then nothing runs
        if action.check:
            before["check"] = _output(executor.run(action.check, timeout_s))
        result = (executor.write(action.path, action.value) if action.kind == "write"
                  else executor.run(action.argv, timeout_s))
        if action.check:
            after["check"] = _output(executor.run(action.check, timeout_s))
        after["exit_code"] = str(result.exit_code)
    elif mode == "dry_run":
        after["dry_run"] = "nothing was executed"
    status = {"dry_run": "planned", "refused": "refused"}.get(mode) or ("ok" if result.exit_code == 0 else "failed")
    record = _record(action, clock, mode, status, reason, result, before, after, operator)
    if mode == "execute":
        log.warning("remediation %s: %s on %s rank %d: %s exited %d", status, action.entry, action.host,
                    action.rank, action.describe(), result.exit_code)
    else:
        log.info("remediation %s: %s on %s rank %d: %s", status, action.entry, action.host, action.rank, reason)
    journal(record)
    return record


def _record(action: Action, clock: Callable[[], int], mode: str, status: str, reason: str,
            result: ExecResult | None, before: dict[str, str], after: dict[str, str], operator: str) -> LogRecord:
    return LogRecord(
        ts_ns=int(clock()), action_id=action.action_id, tenant=action.tenant, job=action.job, host=action.host,
        rank=action.rank, window_start_ns=action.window_start_ns, kb_entry=action.entry, mode=mode,
        status=status, command=action.describe(), reason=reason, risk=action.risk,
        exit_code=result.exit_code if result else -1,
        stdout_head=(result.stdout if result else "")[:OUTPUT_HEAD],
        stderr_head=(result.stderr if result else "")[:OUTPUT_HEAD],
        evidence_before=dict(before), evidence_after=dict(after), operator=operator)


def render(action: Action, record: LogRecord) -> str:
    """What an operator reads for one action."""
    lines = [f"[{record.mode}] {action.entry} on {action.host} rank {action.rank} (risk {action.risk}, "
             f"auto {'yes' if action.auto else 'no'})",
             f"  would run: {action.describe()}" if record.mode != "execute" else f"  ran: {action.describe()}"]
    if action.check:
        lines.append(f"  evidence check: {shlex.join(action.check)}")
    if action.requires:
        lines.append(f"  requires: {', '.join(action.requires)}")
    lines.append(f"  {record.status}: {record.reason}")
    return "\n".join(lines)


def _filler(values: Mapping[str, str], missing: set[str]) -> Callable[[str], str]:
    def sub(m) -> str:
        name = m.group(1)
        v = values.get(name)
        if v is None:
            missing.add(name)
            return f"<missing:{name}>"
        v = str(v)
        why = unsafe_reason(name, v)
        if why:
            missing.add(why)
            return f"<unsafe:{name}>"
        return v
    return lambda text: PLACEHOLDER_RE.sub(sub, text)


def _output(r: ExecResult) -> str:
    text = r.stdout if r.exit_code == 0 else f"exit {r.exit_code}: {r.stderr or r.stdout}"
    return text[:OUTPUT_HEAD]
