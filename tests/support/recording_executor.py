"""A stand-in host for remediation tests: records what would have run, runs nothing."""
from __future__ import annotations

from fleetscope.streams.diagnosis.remediation import ExecResult


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
