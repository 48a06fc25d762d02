"""How a rank's processes ended, from the kernel tracer's exit rows: a crash told from a stop.

The kernel tracer (producers/tracers/kernel.py) sends one ``kernel.process_exit`` row when the last
thread of a traced process exits, with its device saying how: ``signal:<NAME>`` when a signal ended
it, ``exit:<status>`` when it exited. Most ends are not faults: a job that finishes exits 0, and a
launcher that stops its ranks (torchrun after a peer failed, an operator's Ctrl-C, a scheduler's
preemption) sends SIGTERM, SIGINT or SIGHUP. Anything else is a crash: SIGKILL (the OOM killer, or
a node agent that lost patience), SIGSEGV, SIGBUS, SIGABRT (a C++ ``std::terminate``), SIGFPE, or a
non-zero exit status (an uncaught Python exception exits 1).

- ``process_exit_abnormal``: how many of the rank's processes crashed in this window;
- ``process_exit_signal``: the signal number that ended one of them (0 for a non-zero exit
  status), a category for the explanation, not a quantity.

Both are events, present only in the window of the exit: no model scores them and no peer z
compares them (feature_catalogue.EVENT_FEATURES). The loud check ``crashed`` (streams/model/loud.py)
turns them into an alert.
"""
from __future__ import annotations

import signal

from fleetscope.streams.windows import Window

SOURCE, METRIC = "kernel", "kernel.process_exit"
# Signals that ask a process to stop: its launcher's or operator's doing, not the rank's fault.
STOP_SIGNALS = frozenset(("SIGTERM", "SIGINT", "SIGHUP"))
ABNORMAL, SIGNAL = "process_exit_abnormal", "process_exit_signal"


def exit_verdict(device: str) -> tuple[bool, int] | None:
    """(crashed, signal number or 0) of one exit row's device; None for a device this does not read."""
    kind, _, what = device.partition(":")
    if kind == "exit":
        try:
            return int(what) != 0, 0
        except ValueError:
            return None
    if kind == "signal":
        if what in STOP_SIGNALS:
            return False, int(signal.Signals[what])
        try:
            number = int(signal.Signals[what]) if what.startswith("SIG") else int(what)
        except (KeyError, ValueError):
            return None
        return True, number
    return None


def exit_features(w: Window) -> dict[str, float]:
    if SOURCE not in w.sources:
        return {}
    crashed, last_signal = 0.0, None
    for agg in w.devices(SOURCE, METRIC):
        verdict = exit_verdict(agg.device)
        if verdict is not None and verdict[0] and agg.delta_sum > 0:
            crashed += agg.delta_sum
            last_signal = verdict[1]
    if not crashed:
        return {}
    return {ABNORMAL: crashed, SIGNAL: float(last_signal)}
