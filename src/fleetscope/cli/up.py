"""`fleetscope up`: the embedded all-in-one (cli/launcher.py), with a live status line.

Parts: the tansu broker (unless a Kafka is configured), one sink process (it owns
chDB and serves the loopback endpoint), N stream workers (they compute and
publish), and the node agent on a thread here. Ctrl-C stops them in order: the
agent flushes, the workers publish what they hold, the sink stores it, then the
broker goes. Children die with us even if we are killed (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque
from typing import NoReturn

from fleetscope.config import Config
from fleetscope.cli.common import stop_on_interrupt_or_terminate
from fleetscope.cli.launcher import EmbeddedStack, StackError


def _clock(ns: int) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ns / 1e9)) if ns else "-"


def _lag(n: int | None) -> str:
    return "?" if n is None else f"{n:,}"


def status_line(elapsed: float, agent, workers: dict | None, n_workers: int, sink: dict | None, rate: float,
                worker_lag: int | None, sink_lag: int | None) -> str:
    pub = agent.publisher.stats
    line = (f"up {elapsed:5.0f}s | agent: {agent.events_sampled:,} events sampled, "
            f"{pub.batches_sent:,} batches sent, {pub.dropped_events:,} dropped")
    if workers is None:
        line += " | workers: starting…"
    else:
        line += (f" | workers ({n_workers}): {rate:,.0f} events/s in, {workers['windows_out']:,} windows out "
                 f"(last {_clock(workers.get('last_window_end_ns') or 0)}), lag {_lag(worker_lag)} msgs, "
                 f"DLQ {workers['dlq']:,}, late {workers['late_events']:,}")
        if "model_scored" in workers:
            line += (f" | model: {workers['model_scored']:,} scored, {workers['model_anomalies']:,} anomalies, "
                     f"{workers['model_diagnoses']:,} diagnosed ({workers['model_unmatched']:,} unmatched)")
    if sink is None:
        line += " | sink: starting…"
    else:
        line += (f" | sink: {sink['sink_raw_rows']:,} raw rows, {sink['sink_derived_rows']:,} derived rows, "
                 f"{sink['sink_dlq_rows']:,} DLQ rows, lag {_lag(sink_lag)} msgs")
        if sink.get("sink_paused"):
            line += f", PAUSED (store down {sink.get('sink_store_down_s', 0):.0f}s)"
    for source in agent.stat_sources:  # the /proc sampler; the tracer manager, once its BPF programs are loaded
        t = source.stats()
        if "proc_pids" in t:
            line += f" | sampling {t['proc_pids']} rank processes"
        if "trace_targets" in t:
            line += f" | tracing {t['trace_targets']} processes, {t['trace_tracers_running']} tracers"
            if "trace_always_shed" in t:  # the overhead governor's verdict: probe families it keeps off
                line += f", {t['trace_always_shed']} shed"
    return line


def run_up(cfg: Config, duration_s: float | None = None, plain: bool = False, workers: int = 1) -> NoReturn:
    """Run the stack until Ctrl-C (or `duration_s`), stop it in order, and end the process with its status."""
    stop_on_interrupt_or_terminate()  # "Ctrl-C stops everything", however `up` was started
    stack = EmbeddedStack(cfg, workers=workers, agent=True)
    failed = False
    try:
        stack.start()
        print(f"fleetscope up: broker {stack.bootstrap}"
              + (f" (embedded, pid {stack.broker.pid})" if stack.broker else "")
              + f", sink pid {stack.sink.pid}, streams worker pid "
              + ", ".join(str(w.pid) for w in stack.workers)
              + f", store {cfg.clickhouse_url or stack.data_dir / 'chdb'}. Ctrl-C stops everything.", flush=True)
        _watch(stack, duration_s, plain)
    except KeyboardInterrupt:
        pass
    except StackError as exc:
        print(f"fleetscope up: {exc}", flush=True)
        failed = True
    finally:
        stack.stop()
    code = 1 if failed or not stack.exited_cleanly() else 0
    if stack.agent_still_running():  # its native code must not meet the interpreter's teardown (stop_agent)
        print("fleetscope up: the agent did not stop in time; exiting without waiting for it", flush=True)
        code = code or 1
    # Everything `up` started has stopped and said so. What is left is the interpreter's own teardown, where the
    # agent's native libraries (librdkafka, Arrow, the eBPF loaders) are freed while their objects and threads
    # may still be reachable: loaded CI runs saw `up` die by SIGSEGV on Ctrl-C after a clean stop (twice, with
    # nothing printed even with faulthandler on, which is itself disabled late in teardown). So `up` ends here.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _watch(stack: EmbeddedStack, duration_s: float | None, plain: bool) -> None:
    from rich.console import Console
    from rich.live import Live
    console = Console(stderr=False)
    start = time.monotonic()
    history: deque = deque(maxlen=6)  # (time, events_in): the rate is smoothed over ~5 s
    live = None if plain or not console.is_terminal else Live(console=console, refresh_per_second=4)
    if live:
        live.start()
    try:
        while duration_s is None or time.monotonic() - start < duration_s:
            time.sleep(1.0)
            stack.check()
            workers, sink = stack.worker_stats(), stack.sink_stats()
            now = time.monotonic()
            rate = 0.0
            if workers is not None:
                history.append((now, workers["events_in"]))
                (t0, e0), (t1, e1) = history[0], history[-1]
                rate = max(0.0, (e1 - e0) / (t1 - t0)) if t1 > t0 else 0.0
            line = status_line(now - start, stack.agent, workers, len(stack.workers), sink, rate,
                               stack.worker_lag(), stack.sink_lag())
            if live:
                live.update(line)
            else:
                print(line, flush=True)
    finally:
        if live:
            live.stop()
