"""The embedded broker (tansu) started with `--authentication`: every client must pass SASL SCRAM.

tansu 0.6 keeps its users in its storage and creates them only over an
authenticated connection, so a memory-backed broker has no user at all: every
login fails with a real SCRAM `unknown-user` answer. That makes it a real
broker for "authentication fails" and "this client speaks SASL"; a successful
SASL login cannot be shown here.
"""
from __future__ import annotations

import socket
import subprocess
import time

from fleetscope.broker import die_with_parent, free_port, tansu_binary


class AuthenticatingBroker:
    def __init__(self, log_path):
        self.port = free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "AuthenticatingBroker":
        url = f"tcp://{self.bootstrap}"
        self.proc = subprocess.Popen(
            [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/", "--authentication"],
            stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # poll until it listens
            assert self.proc.poll() is None, f"tansu exited at start: {open(self.log_path).read()[-2000:]}"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise AssertionError("tansu --authentication did not listen within 30 s")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
