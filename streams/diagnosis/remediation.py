"""Plan and (only when opted in) run a KB entry's remediation.

Safety rules, all enforced here:
- The default is a dry run: it says what it would run and runs nothing, not
  even the read-only check.
- Executing needs Policy(execute=True) AND the entry in allowed_entries AND
  the host in allowed_hosts. A trigger without an operator (automatic=True)
  also needs the entry's `auto: true`.
- Commands never pass through a shell: the KB's command is split once at load
  time, and each {placeholder} is filled inside its own argv token. A value
  must match SAFE_VALUE (no spaces, quotes or shell characters) and must not
  start with '-', so it cannot smuggle in an option.
- A `write` goes only to a path under /sys/ or /proc/ without '..'.
- Every decision (dry run, refusal, run) yields a LogRecord with evidence from
  before and after, for the remediation_log table.
- The executor is injected: tests pass a recording one; LocalExecutor is the
  only thing that touches the machine, and it acts only on its own host.
"""
from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

from fleetscope.streams.diagnosis.kb import PLACEHOLDER_RE, Entry

SAFE_VALUE = re.compile(r"^[A-Za-z0-9_.,:@/+=][A-Za-z0-9_.,:@/+=-]*$")
OUTPUT_HEAD = 4000  # characters of stdout/stderr kept in the log


class RemediationError(ValueError):
    pass


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
    status: str         # "planned" | "refused" | "ok" | "failed"
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
         params: Mapping[str, str] | None = None, evidence: Mapping[str, float] | None = None) -> Action:
    """Fill the entry's command with the anomaly's identity and the operator's params."""
    values = {"tenant": tenant, "job": job, "host": host, "rank": str(rank), **dict(params or {})}
    rem = entry.remediation
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


def run_action(action: Action, policy: Policy, executor: Executor, *, operator: str = "",
               timeout_s: float = 30.0, clock: Callable[[], int] = time.time_ns) -> LogRecord:
    """Decide, then (only in execute mode) check, act and check again; always log."""
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
    return LogRecord(
        ts_ns=int(clock()), action_id=action.action_id, tenant=action.tenant, job=action.job, host=action.host,
        rank=action.rank, window_start_ns=action.window_start_ns, kb_entry=action.entry, mode=mode,
        status=status, command=action.describe(), reason=reason, risk=action.risk,
        exit_code=result.exit_code if result else -1,
        stdout_head=(result.stdout if result else "")[:OUTPUT_HEAD],
        stderr_head=(result.stderr if result else "")[:OUTPUT_HEAD],
        evidence_before=before, evidence_after=after, operator=operator)


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
        if not SAFE_VALUE.match(v):
            missing.add(f"{name} (unsafe value {v!r})")
            return f"<unsafe:{name}>"
        return v
    return lambda text: PLACEHOLDER_RE.sub(sub, text)


def _output(r: ExecResult) -> str:
    text = r.stdout if r.exit_code == 0 else f"exit {r.exit_code}: {r.stderr or r.stdout}"
    return text[:OUTPUT_HEAD]
