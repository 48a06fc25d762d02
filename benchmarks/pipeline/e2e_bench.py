"""End to end at a paced rate: the fleet produces live (event time = wall clock), one worker computes
and publishes, the sink stores raw and feature rows. Rates step up, a fresh stack per step (tansu's
reads slow down as its partitions grow); stepping stops at the first step that is not sustained.

A step is sustained when the backlog (acked minus the worker's events_in) does not grow faster than
--max-lag-growth of the rate, the worker catches up within --keep-up-s after producing stops, the store
holds exactly the acked raw rows, and every acked event is in a stored feature window (zero loss).
Latencies: raw rows from the store's own clock (ingested_at - ts); feature rows as first seen in the
store by a poller (every --feature-poll-s, so up to that much high) minus the window's start (the worst
case: an event at the window's start), for windows that closed on the watermark during the step."""
from __future__ import annotations

import threading
import time

import numpy as np

from fleetscope.schema import NODE_TENANT

from pipeline.fleet import Fleet, produce_paced
from pipeline.probes import ResourceWindow
from pipeline.stack import BenchStack, log


class FeatureWatcher(threading.Thread):
    """When each feature row of a step's hosts first shows in the store (through the sink's endpoint)."""

    def __init__(self, stack: BenchStack, job_prefix: str, poll_s: float):
        super().__init__(daemon=True)
        self.stack, self.prefix, self.poll_s = stack, job_prefix, poll_s
        self.first_seen_ms: dict[tuple[str, int], int] = {}
        self.errors = 0
        self.halt = threading.Event()

    def run(self) -> None:
        since = 0
        while not self.halt.wait(self.poll_s):
            try:
                rows = self.stack.query(
                    "SELECT job, toUnixTimestamp64Milli(window_start) FROM features WHERE tenant = {t:String} "
                    "AND startsWith(job, {p:String}) AND toUnixTimestamp64Milli(window_start) >= {s:Int64}",
                    {"t": NODE_TENANT, "p": self.prefix, "s": since})
            except Exception:  # a slow answer on a loaded machine: count it, poll again
                self.errors += 1
                continue
            now = time.time_ns() // 10**6
            for job, start in rows:
                self.first_seen_ms.setdefault((job, int(start)), now)
            if rows:
                since = max(int(s) for _, s in rows) - 5000

    def latency_ms(self, cut_ms: int) -> dict | None:
        lat = [seen - start for (_, start), seen in self.first_seen_ms.items() if start + 1000 <= cut_ms]
        if not lat:
            return None
        q = np.percentile(lat, [50, 99, 100])
        return {"windows": len(lat), "p50": int(q[0]), "p99": int(q[1]), "max": int(q[2])}


def run_step(args, stack: BenchStack, idx: int, rate: float) -> dict:
    job_prefix = f"{stack.prefix}-s{idx:02d}-h"
    fleet = Fleet(job_prefix, args.hosts, args.events_per_batch, seed=idx)
    base = stack.stack.worker_stats()
    res = ResourceWindow(stack.probes())
    res.start()
    watcher = FeatureWatcher(stack, job_prefix, args.feature_poll_s)
    watcher.start()
    timeline = []

    def tick(elapsed, enqueued):
        done = stack.events_in() - base["events_in"]
        res.sample()
        timeline.append((round(elapsed, 2), enqueued, done))
        return enqueued - done > rate * args.abort_lag_s  # hopelessly behind: stop producing

    log(f"[{stack.tag}] step {idx}: target {rate:,.0f} events/s for {args.step_s:.0f}s")
    p = produce_paced(stack.producer, stack.topic, fleet, rate, args.step_s, tick)
    resources = res.stop()
    delivered = p["delivery"].events
    caught_up_s = None
    deadline = p["stopped_at"] + args.max_drain_s
    while time.monotonic() < deadline:
        if stack.events_in() - base["events_in"] >= delivered:
            caught_up_s = time.monotonic() - p["stopped_at"]
            break
        time.sleep(0.1)
    idle = stack.wait_idle(args.idle_close_s + args.max_drain_s)  # tail windows close on the idle timer
    watcher.halt.set()
    watcher.join()
    raw = stack.raw_latency(job_prefix)
    windows, feature_events = stack.feature_events(job_prefix)
    end = stack.stack.worker_stats() or base
    cut_ms = p["stopped_at_wall_ns"] // 10**6 - int((args.window_s + args.lateness_s) * 1000)
    achieved = p["enqueued"] / p["produce_s"]
    settled = [(t, enq - done) for t, enq, done in timeline if t >= min(3.0, args.step_s / 3)]
    slope = float(np.polyfit([t for t, _ in settled], [x for _, x in settled], 1)[0]) if len(settled) >= 4 else None
    lag_growing = slope is not None and slope > args.max_lag_growth * rate
    kept_up = not p["aborted"] and not lag_growing and caught_up_s is not None and caught_up_s <= args.keep_up_s
    zero_loss = (raw["rows"] == delivered and feature_events == delivered and p["delivery"].errors == 0
                 and delivered > 0 and end.get("dlq", 0) - base.get("dlq", 0) == 0)
    stored = watcher.latency_ms(cut_ms)
    step = {"step": idx, "target_events_per_s": rate, "produced_events_per_s": round(achieved),
            "duration_s": round(p["produce_s"], 2), "aborted_worker_behind": p["aborted"],
            "producer_limited": not p["aborted"] and achieved < 0.95 * rate,
            "events_acked": delivered, "delivery_errors": p["delivery"].errors,
            "kafka_bytes_per_event": round(p["delivery"].bytes / max(delivered, 1), 3),
            "lag_growth_events_per_s": None if slope is None else round(slope), "lag_growing": lag_growing,
            "caught_up_after_stop_s": None if caught_up_s is None else round(caught_up_s, 2),
            "idle_after": idle["idle"], "raw_rows": raw["rows"], "events_in_stored_windows": feature_events,
            "feature_windows": windows, "loss_events": delivered - raw["rows"],
            "event_to_raw_row_ms": raw["event_to_raw_row_ms"],
            "event_at_window_start_to_stored_feature_row_ms": stored,
            "feature_poll_s": args.feature_poll_s, "feature_watch_errors": watcher.errors,
            "emitted": stack.feature_latency(job_prefix, cut_ms),
            "worker_counters": {k: end.get(k, 0) - base.get(k, 0) for k in
                                ("messages_in", "events_in", "dlq", "windows_out", "flushes", "late_events")},
            "resources": resources, "timeline_s_enqueued_processed": timeline,
            "kept_up": kept_up, "zero_loss": zero_loss}
    step["sustained"] = kept_up and zero_loss
    lat = raw["event_to_raw_row_ms"] or {}
    log(f"[{stack.tag}] step {idx}: produced {achieved:,.0f}/s; caught up "
        f"{'never' if caught_up_s is None else f'{caught_up_s:.1f}s'} after stop; raw {raw['rows']:,}/{delivered:,}, "
        f"in windows {feature_events:,}; raw p99 {lat.get('p99')} ms, feature p99 {(stored or {}).get('p99')} ms; "
        f"worker {resources['worker']['cpu_pct']}% CPU, sink {resources['sink']['cpu_pct']}% "
        f"-> {'SUSTAINED' if step['sustained'] else 'not sustained'}")
    return step


def warm_up(args, stack: BenchStack) -> None:
    """A few seconds at a low rate, until stored: the group has joined and the store's first parts exist."""
    fleet = Fleet(f"{stack.prefix}-warm-h", 4, args.events_per_batch, seed=99)
    p = produce_paced(stack.producer, stack.topic, fleet, 10_000, args.warmup_s, lambda *_: False)
    deadline = time.monotonic() + args.max_drain_s
    while time.monotonic() < deadline and stack.raw_rows(fleet.prefix) < p["delivery"].events:
        time.sleep(0.25)


def step_up(args, run_id: str, rates: list[float], deadline: float) -> tuple[list[dict], bool]:
    """A fresh stack per step; stop at the first step not sustained, then refine once at the midpoint."""
    steps: list[dict] = []
    queue, refine_left, last_pass = list(rates), args.refine, None
    while queue:
        rate = queue.pop(0)
        if time.monotonic() + args.step_s + 40 > deadline:
            log(f"time budget spent: no step at {rate:,.0f}/s")
            return steps, True
        stack = BenchStack(args, run_id, f"e{len(steps) + 1}").start()
        try:
            warm_up(args, stack)
            step = run_step(args, stack, len(steps) + 1, rate)
        finally:
            stack.stop()
        steps.append(step)
        if step["sustained"]:
            last_pass = step
            if step["producer_limited"]:
                log("the producer could not reach the target: stopping the steps")
                break
            continue
        if refine_left and last_pass is not None:
            refine_left -= 1
            mid = round((last_pass["target_events_per_s"] * rate) ** 0.5, -4)
            if last_pass["target_events_per_s"] < mid < rate:
                queue = [mid]
                continue
        queue = []
    return steps, False
