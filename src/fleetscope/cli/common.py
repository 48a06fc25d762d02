"""What every command shares: loading the config, opening the store, parsing --param, terminating children."""
from __future__ import annotations

import faulthandler
import signal
import sys

from fleetscope import config as config_mod


def load_config(args) -> config_mod.Config:
    """The config that --config (or FLEETSCOPE_CONFIG) and the environment give."""
    return config_mod.load(getattr(args, "config", None))


def open_configured_store(cfg: config_mod.Config):
    """The store the config names: a ClickHouse server, the running endpoint, or the embedded chDB."""
    from fleetscope.store import open_store
    return open_store(cfg.data_dir, cfg.database, cfg.clickhouse_url, cfg.ttl_days)


def parse_params(pairs: list[str]) -> dict:
    """NAME=VALUE pairs from repeated --param options."""
    params = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--param expects NAME=VALUE, got {pair!r}")
        params[name] = value
    return params


def kafka_or_explain(cfg: config_mod.Config, command: str) -> str | None:
    """The configured Kafka, or None after telling the user how to give one."""
    if not cfg.kafka:
        print(f"fleetscope {command} needs a Kafka: set FLEETSCOPE_KAFKA=host:port (or `kafka` in the config file).\n"
              "For everything on this machine with an embedded broker, run `fleetscope up`.", file=sys.stderr)
    return cfg.kafka


def _terminate_as_interrupt(signum, frame):
    raise KeyboardInterrupt


def stop_on_interrupt_or_terminate() -> None:
    """Ctrl-C and SIGTERM both unwind the command as KeyboardInterrupt, so it stops what it started.

    SIGINT is set explicitly: a process started in the background by a non-interactive shell inherits
    SIGINT ignored, and Python then installs no KeyboardInterrupt for it (measured: `fleetscope up` under
    `nohup ... &` ignored its Ctrl-C and kept its sink and worker running). Call from the main thread.
    """
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _terminate_as_interrupt)


def print_native_crashes() -> None:
    """A crash in native code (librdkafka, Arrow, chDB, the eBPF loaders) prints every thread's Python stack to
    stderr before the process dies, instead of leaving a bare exit status -11 or -6 (a loaded CI run once saw
    `fleetscope up` end by SIGSEGV on Ctrl-C with nothing to say where). Left alone where a handler is already
    set (pytest's) or stderr has no file descriptor."""
    if faulthandler.is_enabled():
        return
    try:
        faulthandler.enable(file=sys.stderr, all_threads=True)
    except (AttributeError, OSError, ValueError):   # io.UnsupportedOperation is both OSError and ValueError
        pass
