"""Capacity on a backlog: the sink alone, then the minimal pipeline, then one worker alone, all on
the same messages of one stack; and two workers beside the sink on a second stack.

A backlog is produced while the parts that will read it are stopped, with event times spread as a
live fleet at --density events/s stamps them (so windows hold what they would hold live). Each part
is then started and its counter followed to the backlog's size; zero loss is checked in the store."""
from __future__ import annotations

import time

from pipeline.fleet import Fleet, produce_backlog
from pipeline.minimal_bench import minimal_pipeline
from pipeline.probes import ResourceWindow, high_watermarks
from pipeline.stack import BenchStack, follow, log


def _backlog(args, stack: BenchStack, job_prefix: str) -> dict:
    fleet = Fleet(job_prefix, args.hosts, args.events_per_batch, seed=3)
    before = high_watermarks(stack.lag_probe)
    p = produce_backlog(stack.producer, stack.topic, fleet, args.backlog_events, args.density)
    d = p.pop("delivery")
    out = {**p, "events_acked": d.events, "messages_acked": d.messages, "delivery_errors": d.errors,
           "kafka_bytes_per_event": round(d.bytes / max(d.events, 1), 3), "offsets": (before, high_watermarks(stack.lag_probe))}
    log(f"[{stack.tag}] backlog: {d.events:,} events in {d.messages:,} messages ({out['kafka_bytes_per_event']} B/event), "
        f"produced in {p['produce_s']} s, event times over {p['event_time_span_s']} s")
    return out


def _park(stack: BenchStack) -> None:
    """Stop the workers and the sink while nothing is in flight (no data yet, or all stored): the
    launcher's kill, so its liveness check knows they are down on purpose; nothing is lost."""
    st = stack.stack
    for i in range(len(st.workers)):
        st.kill_worker(i)
    st.kill_sink()


def _resources_during(stack: BenchStack, fn):
    res = ResourceWindow(stack.probes())
    res.start()
    out = fn(res)
    return out, res.stop()


def sink_and_worker(args, run_id: str, chdb_dir) -> dict:
    """Stack 1: the sink alone stores the backlog; the minimal pipeline reads the same messages; then one
    worker alone (sink stopped) computes over them; then the sink stores the worker's feature rows."""
    stack = BenchStack(args, run_id, "d1", workers=1).start()
    out: dict = {}
    try:
        st = stack.stack
        _park(stack)
        job_prefix = f"{stack.prefix}-h"
        bl = out["backlog"] = _backlog(args, stack, job_prefix)
        n = bl["events_acked"]

        # 1. the sink alone
        st.restart_sink()
        msgs = bl["messages_acked"]

        def stored_and_committed() -> int:  # the sink commits a poll once its inserts are done
            lag = st.sink_lag()
            return 0 if lag is None else (msgs - min(lag, msgs)) * args.events_per_batch
        f, res = _resources_during(stack, lambda r: follow(lambda: (r.sample(), stored_and_committed())[1], n,
                                                             args.max_drain_s))
        stored = stack.raw_rows(job_prefix)
        out["sink"] = {"events_per_s": f["events_per_s"], "drained": f["reached"], "seconds": f["seconds"],
                       "raw_rows_stored": stored, "zero_loss": stored == n and bl["delivery_errors"] == 0,
                       "resources": res, "timeline": f["timeline"], "sink_stats": st.sink_stats()}
        log(f"[d1] sink alone: {f['events_per_s']} rows/s, {stored:,}/{n:,} rows stored, "
            f"sink CPU {res['sink']['cpu_pct']}%")

        # 2. the minimal pipeline over the same offsets, in this process
        start, end = bl.pop("offsets")
        out["minimal"] = minimal_pipeline(stack.broker.bootstrap, stack.topic, start, end, chdb_dir,
                                          args.minimal_poll_messages, args.max_drain_s)
        log(f"[d1] minimal pipeline: {out['minimal']['events_per_s']} events/s, "
            f"{out['minimal']['rows_stored']:,} rows stored")

        # 3. one worker alone: the sink is stopped (it has stored and committed all), nothing else reads
        st.kill_sink()
        st.restart_worker(0)
        f, res = _resources_during(stack, lambda r: follow(lambda: (r.sample(), stack.events_in())[1], n,
                                                             args.max_drain_s, poll_s=0.25))
        idle = stack.wait_idle(args.idle_close_s + 20)
        ws = st.worker_stats() or {}
        # 4. the sink stores what the worker published; every event must be in one stored window
        st.restart_sink()
        sink_idle = stack.wait_idle(args.max_drain_s)
        windows, feature_events = stack.feature_events(job_prefix)
        lost = n - feature_events
        out["worker"] = {"events_per_s": f["events_per_s"], "drained": f["reached"], "seconds": f["seconds"],
                         "events_in": ws.get("events_in"), "dlq": ws.get("dlq"), "late_events": ws.get("late_events"),
                         "windows_out": ws.get("windows_out"), "model_scored": ws.get("model_scored"),
                         "feature_windows_stored": windows, "events_in_stored_windows": feature_events,
                         "zero_loss": (lost == 0 and ws.get("dlq") == 0 and ws.get("late_events") == 0
                                       and idle["idle"] and sink_idle["idle"]),
                         "resources": res, "timeline": f["timeline"]}
        log(f"[d1] one worker alone: {f['events_per_s']} events/s; {feature_events:,}/{n:,} events in "
            f"{windows} stored windows; dlq {ws.get('dlq')}, late {ws.get('late_events')}; worker CPU "
            f"{res['worker']['cpu_pct']}%, RSS max {res['worker']['rss_mb_max']} MB")
    finally:
        stack.stop()
    return out


def two_workers(args, run_id: str) -> dict:
    """Stack 2: a fresh backlog, then the sink and two workers (one group) started together: the
    workers' summed rate while the sink stores the raw rows and their feature rows, broker beside."""
    stack = BenchStack(args, run_id, "d2", workers=2).start()
    try:
        st = stack.stack
        _park(stack)
        job_prefix = f"{stack.prefix}-h"
        bl = _backlog(args, stack, job_prefix)
        bl.pop("offsets")
        n = bl["events_acked"]
        st.restart_sink()
        t_start = time.monotonic()
        for i in range(2):
            st.restart_worker(i)
        f, res = _resources_during(stack, lambda r: follow(lambda: (r.sample(), stack.events_in())[1], n,
                                                             args.max_drain_s, poll_s=0.25, start=t_start))
        per_worker = [w.pid for w in st.workers]
        idle = stack.wait_idle(args.max_drain_s)
        ws = st.worker_stats() or {}
        raw = stack.raw_rows(job_prefix)
        windows, feature_events = stack.feature_events(job_prefix)
        out = {"backlog": bl, "events_per_s": f["events_per_s"], "drained": f["reached"], "seconds": f["seconds"],
               "worker_pids": per_worker, "raw_rows_stored": raw, "events_in_stored_windows": feature_events,
               "feature_windows_stored": windows, "dlq": ws.get("dlq"), "late_events": ws.get("late_events"),
               "zero_loss": raw == n and feature_events == n and ws.get("dlq") == 0 and idle["idle"],
               "resources": res, "timeline": f["timeline"]}
        log(f"[d2] two workers + sink: {f['events_per_s']} events/s; raw {raw:,}/{n:,}, "
            f"{feature_events:,}/{n:,} events in stored windows")
        return out
    finally:
        stack.stop()
