"""The `fleetscope` command line: the only top layer, composing the core, the agent, the workers and the harness."""
from fleetscope.cli.main import main

__all__ = ["main"]
