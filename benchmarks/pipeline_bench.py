"""Pipeline throughput and latency: synthetic fleet -> embedded broker -> one streams worker -> chDB.

Goals (issue 2):
- the events/s that one worker sustains with zero loss;
- that rate is at least 0.5x what a bare confluent-kafka consume loop reads
  from the same broker, measured in the same run on the same messages;
- p99 event -> row latency at 1 s windows is at most 3 s.

What runs: tansu (EmbeddedBroker), one `python -m fleetscope streams`
subprocess (its own chDB in a temporary data dir, its own topic prefix and
consumer group), and, in this process, a paced confluent-kafka producer that
plays a fleet of hosts. Each host sends `host`-source metric batches whose
columns are exactly SOURCE_COLUMNS["host"]: one sample time per batch, one
row per (metric, device), so every row's sort key is unique and the
ReplacingMergeTree can never fold two of them.

The target rate steps up; a step is sustained when the worker keeps up (the
backlog, sampled each second from /stats, does not grow by more than
--max-lag-growth of the rate, and after producing stops events_in reaches
what the broker acknowledged within --keep-up-s) and raw_metrics holds
exactly that many rows for the step's hosts (each step uses fresh host
names). Stepping stops at the first step that fails (and, with --refine,
tries the midpoint once). Latencies come from the store: ingested_at - ts
per raw row, emitted_at - window_end/start per feature row. After each step a
bare confluent-kafka consumer reads that step's messages back (its offset
range, with the broker holding what it held for the worker: tansu's reads slow
down as a partition grows), and the ratio compares the two. At the end a probe
times a parked aiokafka fetch, and a short in-process section timing (same
batch shape) shows where the worker's time per event goes.

Diagnosis only: --profile-worker PATH (cProfile of the worker) and
--what-if-fetch-wait-ms MS (the unchanged worker with another aiokafka fetch
wait than the 1500 ms Faust hard-codes).

Writes benchmarks/results/pipeline.json. Only measured numbers go in it.
Every process started here is stopped on exit, error or Ctrl-C.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
from fleetscope import config as config_mod  # noqa: E402
from fleetscope.cli.launcher import EmbeddedStack  # noqa: E402
from fleetscope.schema import NODE_TENANT, SOURCE_COLUMNS, node_identity, validate  # noqa: E402
from fleetscope.topics import ensure_topics  # noqa: E402
from fleetscope.wire import Batch, StrColumn, decode, encode  # noqa: E402

GOAL_RATIO = 0.5
GOAL_P99_S = 3.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


# ---- the synthetic fleet ---------------------------------------------------------

CPU_STATES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
NODE_METRICS = (("mem.total", 0), ("mem.available", 0), ("mem.anon", 0), ("mem.anon_huge", 0),
                ("vm.pgfault", 1), ("vm.pgmajfault", 1), ("vm.numa_hit", 1), ("vm.numa_miss", 1),
                ("cpu.context_switches", 1), ("irq.cpu_total", 1))


def metric_catalogue(n: int) -> tuple[np.ndarray, tuple, np.ndarray, tuple, np.ndarray]:
    """n distinct (metric, device) pairs shaped like a big host's sampler output:
    node-wide gauges and counters, then per-CPU time deltas, then NIC/disk deltas."""
    pairs: list[tuple[str, str, int]] = [(m, "all", d) for m, d in NODE_METRICS]
    pairs += [(f"cpu.{s}", "all", 1) for s in CPU_STATES]
    cpu = 0
    while len(pairs) < n:
        for dev_metric in ([(f"cpu.{s}", f"cpu{cpu}") for s in CPU_STATES]
                           + [("net.rx_bytes", f"eth{cpu}"), ("net.tx_bytes", f"eth{cpu}"),
                              ("disk.read_bytes", f"nvme{cpu}n1"), ("disk.write_bytes", f"nvme{cpu}n1")]):
            pairs.append((*dev_metric, 1))
        cpu += 1
    pairs = pairs[:n]
    metrics = tuple(sorted({p[0] for p in pairs}))
    devices = tuple(sorted({p[1] for p in pairs}))
    m_idx = {m: i for i, m in enumerate(metrics)}
    d_idx = {d: i for i, d in enumerate(devices)}
    m_codes = np.array([m_idx[p[0]] for p in pairs], dtype=np.uint32)
    d_codes = np.array([d_idx[p[1]] for p in pairs], dtype=np.uint32)
    is_delta = np.array([p[2] for p in pairs], dtype=bool)
    return m_codes, metrics, d_codes, devices, is_delta


class Fleet:
    """Synthetic hosts; each batch is one sample tick of one host at the real current time."""

    def __init__(self, prefix: str, n_hosts: int, events_per_batch: int, seed: int = 7):
        self.hosts = [f"{prefix}{i:02d}" for i in range(n_hosts)]
        self.n = events_per_batch
        m_codes, metrics, d_codes, devices, is_delta = metric_catalogue(events_per_batch)
        self.metric, self.device = StrColumn(m_codes, metrics), StrColumn(d_codes, devices)
        self.rng = np.random.default_rng(seed)
        self.values = self.rng.random((64, self.n)) * 1e6  # a few value sets, reused
        self.identity = {h: node_identity(h, self.n) for h in self.hosts}
        self.last_ts = {h: 0 for h in self.hosts}
        self.interval_ns = {}
        self.is_delta = is_delta
        self._i = 0

    def next_batch(self) -> Batch:
        host = self.hosts[self._i % len(self.hosts)]
        ts = time.time_ns()
        prev = self.last_ts[host] or ts - 10**9
        ts = max(ts, prev + 1)  # strictly increasing per host: unique sort keys
        self.last_ts[host] = ts
        cols = {"ts_ns": np.full(self.n, ts, dtype="<i8"), **self.identity[host],
                "metric": self.metric, "device": self.device,
                "value": self.values[self._i % len(self.values)],
                "interval_ns": np.where(self.is_delta, ts - prev, 0).astype("<i8")}
        self._i += 1
        assert set(cols) == set(SOURCE_COLUMNS["host"])
        return Batch("host", host, cols, created_ns=ts)


# ---- processes: the worker, CPU/RSS probes ------------------------------------------------

class Worker:
    """The bench's view of the launcher's stack (fleetscope.cli.launcher): the workers' and the sink's
    counters, and SQL through the sink's endpoint."""

    def __init__(self, stack: EmbeddedStack):
        self.stack = stack

    @staticmethod
    def argv(profile_path: str | None = None, fetch_wait_ms: int | None = None) -> list[str]:
        cmd = [sys.executable, "-m", "fleetscope", "streams"]
        if profile_path:  # cProfile of the main thread (Faust's event loop), written when it stops
            cmd[1:1] = ["-m", "cProfile", "-o", profile_path]
        elif fetch_wait_ms is not None:  # what-if: the same worker with another aiokafka fetch wait
            cmd = [sys.executable, "-c", WHAT_IF_FETCH_WAIT, str(fetch_wait_ms)]
        return cmd

    def tail(self, n: int = 3000) -> str:
        return "\n".join(p.tail(n) for p in [*self.stack.workers, self.stack.sink] if p is not None)

    def alive(self) -> bool:
        return all(p.alive() for p in [*self.stack.workers, self.stack.sink] if p is not None)

    def stats(self) -> dict:
        self.stack.check()  # a dead worker or sink raises with its log's name
        s = self.stack.stats()
        if s is None:
            raise RuntimeError(f"no counters from the stack; log tails:\n{self.tail()}")
        return s

    def query(self, sql: str, params: dict | None = None) -> list[tuple]:
        return self.stack.query(sql, params).rows


# Faust's aiokafka driver hard-codes fetch_max_wait_ms=1500; this runs the unchanged worker with
# another value, to measure what that setting costs (diagnosis only, never the default).
WHAT_IF_FETCH_WAIT = """
import sys, aiokafka
_wait = int(sys.argv[1])
class _Consumer(aiokafka.AIOKafkaConsumer):
    def __init__(self, *a, **kw):
        kw["fetch_max_wait_ms"] = _wait
        super().__init__(*a, **kw)
aiokafka.AIOKafkaConsumer = _Consumer
from fleetscope.cli import main
sys.exit(main(["streams"]))
"""


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()  # after comm: state, ppid, pgrp, ...
    except (OSError, IndexError):
        return None


def group_pids(pgid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            f = _stat_fields(int(name))
            if f and int(f[2]) == pgid:
                out.append(int(name))
    return out


class ProcProbe:
    """CPU seconds (utime+stime, all threads) and RSS of a set of processes."""

    def __init__(self, name: str, pids_fn):
        self.name, self.pids_fn = name, pids_fn
        self.pids = pids_fn()

    def cpu_s(self) -> float:
        ticks = 0
        for pid in self.pids:
            f = _stat_fields(pid)
            if f:
                ticks += int(f[11]) + int(f[12])
        return ticks / CLK_TCK

    def rss_mb(self) -> float:
        kb = 0
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            kb += int(line.split()[1])
            except OSError:
                pass
        return kb / 1024


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies over all CPUs, from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


class ResourceWindow:
    """CPU % (100 = one core) and RSS of each probe between start() and stop()."""

    def __init__(self, probes: list[ProcProbe]):
        self.probes = probes

    def start(self) -> None:
        self.t = time.monotonic()
        self.cpu0 = {p.name: p.cpu_s() for p in self.probes}
        self.mach0 = machine_busy()
        self.rss_max = {p.name: p.rss_mb() for p in self.probes}

    def sample(self) -> None:
        for p in self.probes:
            self.rss_max[p.name] = max(self.rss_max[p.name], p.rss_mb())

    def stop(self) -> dict:
        dt = time.monotonic() - self.t
        busy1, total1 = machine_busy()
        out = {p.name: {"cpu_pct": round(100 * (p.cpu_s() - self.cpu0[p.name]) / dt, 1),
                        "rss_mb_max": round(self.rss_max[p.name], 1), "rss_mb_end": round(p.rss_mb(), 1)}
               for p in self.probes}
        cores = os.cpu_count() or 1
        out["machine_busy_pct_of_all_cores"] = round(100 * (busy1 - self.mach0[0]) / max(total1 - self.mach0[1], 1), 1)
        out["machine_cores"] = cores
        return out


# ---- one step: produce at a target rate, then check drain, rows, latency ---------------

def make_producer(bootstrap: str):
    from confluent_kafka import Producer
    return Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True,
                     "linger.ms": 5, "queue.buffering.max.messages": 100_000,
                     "client.id": "pipeline-bench", "log.connection.close": False})


class Delivery:
    def __init__(self):
        self.events = self.messages = self.errors = 0

    def callback(self, count: int):
        def done(err, _msg):
            if err is None:
                self.events += count
                self.messages += 1
            else:
                self.errors += 1
        return done


def produce_paced(producer, topic: str, fleet: Fleet, rate: float, duration_s: float, tick) -> dict:
    """Produce `rate` events/s for duration_s; tick(elapsed, enqueued) runs about once a second
    and may return True to stop early (the worker fell too far behind)."""
    delivery = Delivery()
    enqueued = 0
    encode_s = 0.0
    aborted = False
    start = time.monotonic()
    next_tick = 1.0
    while True:
        elapsed = time.monotonic() - start
        if elapsed >= duration_s:
            break
        due = int(rate * elapsed) - enqueued
        while due >= fleet.n:
            t = time.perf_counter()
            batch = fleet.next_batch()
            value = encode(batch)
            encode_s += time.perf_counter() - t
            while True:
                try:
                    producer.produce(topic, key=f"{NODE_TENANT}/{batch.host}".encode(), value=value,
                                     headers=batch.kafka_headers(), on_delivery=delivery.callback(batch.count))
                    break
                except BufferError:
                    producer.poll(0.01)
            enqueued += batch.count
            due -= fleet.n
        producer.poll(0)
        if elapsed >= next_tick:
            next_tick += 1.0
            if tick(elapsed, enqueued):
                aborted = True
                break
        time.sleep(0.001)
    produce_s = time.monotonic() - start
    stopped_at, stopped_at_wall_ns = time.monotonic(), time.time_ns()
    unflushed = producer.flush(60)
    return {"delivery": delivery, "enqueued": enqueued, "produce_s": produce_s, "encode_s": encode_s,
            "aborted": aborted, "unflushed": unflushed, "stopped_at_wall_ns": stopped_at_wall_ns,
            "stopped_at": stopped_at}


def raw_latency(worker: Worker, job_prefix: str) -> dict:
    rows = worker.query(
        "SELECT count(), uniqExact(batch_id), "
        "quantilesExact(0.5, 0.9, 0.99, 1)(toUnixTimestamp64Milli(ingested_at) - intDiv(toUnixTimestamp64Nano(ts), 1000000)) "
        "FROM raw_metrics WHERE tenant = {t:String} AND startsWith(job, {p:String})",
        {"t": NODE_TENANT, "p": job_prefix})
    count, batches, q = rows[0]
    return {"rows": int(count), "batches": int(batches),
            "event_to_raw_row_ms": dict(zip(("p50", "p90", "p99", "max"), [int(v) for v in q])) if count else None}


def feature_latency(worker: Worker, job_prefix: str, steady_cut_ms: int) -> dict:
    """Windows that closed by watermark while the step ran ("steady"), and the tail windows that
    closed by the idle timer after the fleet went quiet (their latency includes idle_close_s)."""
    out = {}
    for name, cond in (("steady", "<="), ("tail_idle_closed", ">")):
        rows = worker.query(
            "SELECT count(), sum(event_count), "
            "quantilesExact(0.5, 0.99, 1)(toUnixTimestamp64Milli(emitted_at) - toUnixTimestamp64Milli(window_end)), "
            "quantilesExact(0.5, 0.99, 1)(toUnixTimestamp64Milli(emitted_at) - toUnixTimestamp64Milli(window_start)) "
            "FROM features WHERE tenant = {t:String} AND startsWith(job, {p:String}) "
            f"AND toUnixTimestamp64Milli(window_end) {cond} {{cut:Int64}}",
            {"t": NODE_TENANT, "p": job_prefix, "cut": steady_cut_ms})
        n, events, q_end, q_start = rows[0]
        keys = ("p50", "p99", "max")
        out[name] = {"windows": int(n), "events": int(events or 0),
                     "window_end_to_feature_row_ms": dict(zip(keys, map(int, q_end))) if n else None,
                     "event_at_window_start_to_feature_row_ms": dict(zip(keys, map(int, q_start))) if n else None}
    return out


class CommittedLag:
    """The worker group's committed offsets against the high watermarks, per partition."""

    def __init__(self, bootstrap: str, group: str, topic: str, partitions: int):
        from confluent_kafka import Consumer, TopicPartition
        self._c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False,
                            "log.connection.close": False})
        self._tps = [TopicPartition(topic, p) for p in range(partitions)]

    def partitions(self) -> list[dict] | None:
        try:
            out = []
            for tp in self._c.committed(self._tps, timeout=2.0):
                low, high = self._c.get_watermark_offsets(tp, timeout=2.0)
                out.append({"partition": tp.partition, "committed": tp.offset, "low": low, "high": high})
            return out
        except Exception:  # best effort: a probe failure is reported as null
            return None

    def lag(self) -> int | None:
        parts = self.partitions()
        return None if parts is None else sum(p["high"] - (p["committed"] if p["committed"] >= 0 else p["low"])
                                              for p in parts)

    def close(self) -> None:
        self._c.close()


def run_step(args, idx: int, rate: float, duration_s: float, run_id: str, topic: str,
             producer, worker: Worker, probes: list[ProcProbe], lag_probe: CommittedLag, label: str) -> dict:
    job_prefix = f"{run_id}-s{idx:02d}-h"
    fleet = Fleet(job_prefix, args.hosts, args.events_per_batch, seed=idx)
    base = worker.stats()
    offsets_before = high_watermarks(lag_probe)
    res = ResourceWindow(probes)
    res.start()
    timeline = []

    def tick(elapsed, enqueued):
        s = worker.stats()
        res.sample()
        timeline.append((round(elapsed, 2), enqueued, s["events_in"] - base["events_in"]))
        return enqueued - timeline[-1][2] > rate * args.abort_lag_s  # hopelessly behind: stop producing

    log(f"{label}: target {rate:,.0f} events/s for {duration_s:.0f}s ({args.hosts} hosts, "
        f"{args.events_per_batch} events/batch)")
    p = produce_paced(producer, topic, fleet, rate, duration_s, tick)
    resources = res.stop()
    delivered = p["delivery"].events
    at_stop = worker.stats()
    lag_events_at_stop = p["enqueued"] - (at_stop["events_in"] - base["events_in"])
    committed_lag_msgs_at_stop = lag_probe.lag()

    # drain: events_in reaches what the broker acknowledged
    caught_up_s = None
    deadline = p["stopped_at"] + args.max_drain_s
    while time.monotonic() < deadline:
        s = worker.stats()
        if s["events_in"] - base["events_in"] >= delivered:
            caught_up_s = time.monotonic() - p["stopped_at"]
            break
        time.sleep(0.1)
    # zero loss: raw_metrics holds exactly the acknowledged events for this step's hosts
    rows_s, raw = None, {"rows": 0}
    while time.monotonic() < deadline + 5:
        raw = raw_latency(worker, job_prefix)
        if raw["rows"] >= delivered:
            rows_s = time.monotonic() - p["stopped_at"]
            break
        time.sleep(0.25)
    end = worker.stats()

    achieved = p["enqueued"] / p["produce_s"]
    worker_rates = [(b[2] - a[2]) / (b[0] - a[0]) for a, b in zip(timeline, timeline[1:]) if b[0] > a[0]]
    producer_limited = not p["aborted"] and achieved < 0.95 * rate
    # the backlog's trend after the start-up transient: a worker that keeps up holds it flat
    settled = [(t, enq - done) for t, enq, done in timeline if t >= min(3.0, duration_s / 3)]
    lag_slope = float(np.polyfit([t for t, _ in settled], [lag for _, lag in settled], 1)[0]) if len(settled) >= 4 else None
    lag_growing = lag_slope is not None and lag_slope > args.max_lag_growth * rate
    kept_up = (not p["aborted"] and not lag_growing and caught_up_s is not None
               and caught_up_s <= args.keep_up_s)
    loss = delivered - raw["rows"]
    counters = {k: end[k] - base[k] for k in ("messages_in", "events_in", "dlq", "duplicate_batches", "windows_out",
                                              "flushes", "store_errors", "late_events", "replayed_events")}
    step = {
        "label": label, "job_prefix": job_prefix, "target_events_per_s": rate,
        "duration_s": round(p["produce_s"], 2), "aborted_worker_behind": p["aborted"],
        "produced_events_per_s": round(achieved), "producer_limited": producer_limited,
        "hosts": args.hosts, "events_per_batch": args.events_per_batch,
        "messages_acked": p["delivery"].messages, "events_acked": delivered,
        "delivery_errors": p["delivery"].errors, "unflushed_after_60s": p["unflushed"],
        "producer_encode_s": round(p["encode_s"], 2),
        "worker_events_in": counters["events_in"],
        "worker_events_per_s_1s_max": round(max(worker_rates)) if worker_rates else None,
        "worker_events_per_s_over_step_and_drain": (round(delivered / (p["produce_s"] + caught_up_s))
                                                    if caught_up_s is not None else None),
        "lag_events_max_during": max((t[1] - t[2] for t in timeline), default=None),
        "lag_growth_events_per_s": None if lag_slope is None else round(lag_slope),
        "lag_growing": lag_growing,
        "lag_events_at_stop": lag_events_at_stop,
        "committed_lag_messages_at_stop": committed_lag_msgs_at_stop,
        "caught_up_after_stop_s": None if caught_up_s is None else round(caught_up_s, 2),
        "all_rows_stored_after_stop_s": None if rows_s is None else round(rows_s, 2),
        "raw_rows": raw["rows"], "raw_batches": raw.get("batches"), "loss_events": loss,
        "latency": {"event_to_raw_row_ms": raw.get("event_to_raw_row_ms")},
        "worker_counters": counters, "flush_events_mean": round(counters["events_in"] / max(counters["flushes"], 1)),
        "resources": resources,
        "timeline_s_enqueued_processed": timeline,
        "kept_up": kept_up, "zero_loss": loss == 0 and p["delivery"].errors == 0 and delivered > 0,
        "_offsets": (offsets_before, high_watermarks(lag_probe)),
        "_stopped_at": p["stopped_at"],
        "_steady_cut_ms": p["stopped_at_wall_ns"] // 10**6 - int((args.window_s + args.lateness_s) * 1000),
    }
    step["sustained"] = step["kept_up"] and step["zero_loss"]
    lat = raw.get("event_to_raw_row_ms") or {}
    log(f"{label}: produced {achieved:,.0f}/s{' (stopped early: worker behind)' if p['aborted'] else ''}, acked "
        f"{delivered:,} events; caught up {'never' if caught_up_s is None else f'{caught_up_s:.1f}s'} after stop; "
        f"rows {raw['rows']:,} (loss {loss}); raw p50/p99 {lat.get('p50')}/{lat.get('p99')} ms; "
        f"worker {resources['worker']['cpu_pct']}% CPU, broker {resources['broker']['cpu_pct']}%, "
        f"machine {resources['machine_busy_pct_of_all_cores']}% of {resources['machine_cores']} cores "
        f"-> {'SUSTAINED' if step['sustained'] else 'not sustained'}")
    return step


def fetch_wait_probe(bootstrap: str, topic: str, producer, rounds: int = 8) -> dict:
    """Produce->receive latency of one small message through aiokafka (Faust's client) with the
    fetch_max_wait_ms that Faust's aiokafka driver hard-codes (1500) and with 10 ms, same broker.
    Shows how much of the event->row latency is a parked fetch, not the worker."""
    import asyncio

    import aiokafka

    async def one(wait_ms: int) -> list[float]:
        c = aiokafka.AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                      fetch_max_wait_ms=wait_ms, auto_offset_reset="latest")
        await c.start()
        try:
            tp = aiokafka.TopicPartition(topic, 0)
            c.assign([tp])
            await c.seek_to_end(tp)
            await c.getmany(timeout_ms=300)
            lats = []
            for i in range(rounds):
                await asyncio.sleep(0.05 + 0.17 * (i % 3))  # land at different points of a parked fetch
                t = time.monotonic()
                producer.produce(topic, value=b"probe", key=b"probe", partition=0)
                producer.flush(5)
                got = False
                while not got and time.monotonic() - t < 5:
                    for msgs in (await c.getmany(timeout_ms=3000)).values():
                        got = got or any(m.value == b"probe" for m in msgs)
                lats.append(time.monotonic() - t)
            return lats
        finally:
            await c.stop()

    out = {}
    for wait_ms in (1500, 10):
        lats = sorted(asyncio.run(one(wait_ms)))
        out[f"fetch_max_wait_ms_{wait_ms}"] = {"p50_ms": round(1000 * lats[len(lats) // 2], 1),
                                               "max_ms": round(1000 * lats[-1], 1), "rounds": len(lats)}
    return out


# ---- the bare consumer -------------------------------------------------------------

def high_watermarks(lag_probe: "CommittedLag") -> list[int]:
    return [p["high"] for p in lag_probe.partitions() or []]


def bare_consume(bootstrap: str, topic: str, start: list[int], end: list[int], events_per_msg: int,
                 passes: int, cap_s: float) -> dict:
    """A plain confluent-kafka consume loop over one step's messages (its offset range, so the
    broker holds what it held when the worker read them): assign, lowered fetch wait,
    consume(num_messages=...), decode nothing. The consumer first connects with nothing to read
    (assigned at the end offsets), then the clock runs from re-assigning the step's start offsets
    to its last message, so set-up is not counted but every fetch is. A pass stops at cap_s and
    then reports the rate of what it read."""
    from confluent_kafka import Consumer, TopicPartition
    expect = sum(e - s for s, e in zip(start, end))
    runs = []
    for _ in range(passes):
        c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bare-{uuid.uuid4().hex[:8]}",
                      "enable.auto.commit": False, "fetch.wait.max.ms": 5, "fetch.min.bytes": 1,
                      "fetch.error.backoff.ms": 5, "log.connection.close": False})
        n = nbytes = 0
        try:
            c.assign([TopicPartition(topic, p, off) for p, off in enumerate(end)])
            c.consume(num_messages=1, timeout=1.0)  # connect, metadata; nothing to read yet
            t0 = time.perf_counter()
            c.assign([TopicPartition(topic, p, off) for p, off in enumerate(start)])
            deadline = t0 + cap_s
            while n < expect and time.perf_counter() < deadline:
                for m in c.consume(num_messages=1000, timeout=0.1):
                    if m.error() is None:
                        n += 1
                        nbytes += len(m.value())
            dt = time.perf_counter() - t0
        finally:
            c.close()
        runs.append({"messages": n, "complete": n >= expect, "seconds": round(dt, 3),
                     "events_per_s": round(n * events_per_msg / dt), "messages_per_s": round(n / dt),
                     "mb_per_s": round(nbytes / 2**20 / dt, 1)})
    best = max(runs, key=lambda r: r["events_per_s"])
    return {"messages_in_range": expect, "offsets_start": start, "offsets_end": end, "passes": runs,
            "events_per_s_best": best["events_per_s"]}


# ---- where the worker's time goes, same batch shape, in this process ------------------------

def section_timings(args, rate: float, flush_events: int) -> dict:
    """Per-event cost of each stage the worker runs, on one core in this process, for one window's
    worth of the fleet at `rate` (so batches per window match the run) and inserts of the run's
    mean flush size. The sum predicts one worker's ceiling without Faust, Kafka or background
    merges. Uses a throwaway chDB dir (this process holds no other)."""
    from fleetscope.streams.features import window_features
    from fleetscope.streams.sinks import RawSink
    from fleetscope.streams.windows import WindowAssembler
    fleet = Fleet("sections-h", args.hosts, args.events_per_batch)
    n_batches = max(round(rate * args.window_s / args.events_per_batch), len(fleet.hosts))
    payloads = [(encode(b), b.kafka_headers()) for b in (fleet.next_batch() for _ in range(n_batches))]
    events = n_batches * args.events_per_batch
    flush_batches = max(1, min(n_batches, round(flush_events / args.events_per_batch)))
    flush_n = flush_batches * args.events_per_batch
    out = {"rate_events_per_s": rate, "batches": n_batches, "events": events, "insert_flush_events": flush_n}

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return best

    batches = [decode(v, h) for v, h in payloads]
    out["decode_validate_us_per_event"] = timed(lambda: [validate(decode(v, h)) for v, h in payloads]) / events * 1e6
    wa_holder = {}

    def fold():
        wa = WindowAssembler(args.window_s, args.lateness_s, 5.0)
        for b in batches:
            wa.add(b, object())
        wa_holder["wa"] = wa
    out["windows_add_us_per_event"] = timed(fold) / events * 1e6
    windows = list(wa_holder["wa"].open.values())
    out["window_features_us_per_event"] = timed(lambda: [window_features(w) for w in windows]) / events * 1e6
    out["raw_rows_build_us_per_event"] = timed(lambda: RawSink._metric_rows(batches)) / events * 1e6
    try:
        from fleetscope.store.chdb_store import ChdbStore
        d = Path(tempfile.mkdtemp(prefix="fs-bench-sections-"))
        try:
            store = ChdbStore(d / "chdb", "fleetscope", 7)
            store.migrate()
            rows = RawSink._metric_rows(batches[:flush_batches])
            i = iter(range(10**6))
            out["chdb_raw_insert_us_per_event"] = timed(
                lambda: store.insert("raw_metrics", rows, dedupe_token=f"s{next(i)}")) / flush_n * 1e6
            from fleetscope.streams.sinks import FeatureSink
            sink = FeatureSink(config_mod.Config(), store, None)  # no producer: the insert alone
            out["chdb_features_insert_us_per_event"] = timed(lambda: sink.write(windows)) / events * 1e6 - \
                out["window_features_us_per_event"]  # write() also computes the vectors, timed above
            t = time.perf_counter()
            store.query("SELECT 1")
            out["chdb_query_round_trip_ms"] = round((time.perf_counter() - t) * 1000, 2)
            store.close()
        finally:
            shutil.rmtree(d, ignore_errors=True)
    except Exception as exc:  # report, never fail the run for the optional part
        out["chdb_raw_insert_error"] = str(exc)
    stage_keys = [k for k in out if k.endswith("_us_per_event")]
    out["windows"] = len(windows)
    total = sum(out[k] for k in stage_keys)
    out = {k: (round(v, 3) if k.endswith("_us_per_event") else v) for k, v in out.items()}
    out["sum_us_per_event"] = round(total, 3)
    out["predicted_single_core_ceiling_events_per_s"] = round(1e6 / total) if total else None
    out["share_of_sum"] = {k: round(out[k] / total, 3) for k in stage_keys} if total else {}
    return out


# ---- main ------------------------------------------------------------------------

def code_state() -> dict:
    """The commit and any uncommitted changes outside benchmarks/: the code this run measured.
    Others commit while benchmarks run; a change between start and end makes the run suspect."""
    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    dirty = git("status", "--porcelain", "--", ".", ":(exclude)benchmarks")
    diff = git("diff", "HEAD", "--", ".", ":(exclude)benchmarks")
    return {"commit": git("rev-parse", "HEAD"), "uncommitted_outside_benchmarks": (dirty or "").splitlines(),
            "diff_sha1": hashlib.sha1((diff or "").encode()).hexdigest()[:12]}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="25000,50000,75000,100000,125000,150000,200000,300000,400000",
                    help="target events/s steps, comma-separated; stops at the first that fails (default: %(default)s)")
    ap.add_argument("--step-s", type=float, default=20.0, help="seconds of production per step")
    ap.add_argument("--hosts", type=int, default=32, help="simulated hosts per step (each its own job key)")
    ap.add_argument("--events-per-batch", type=int, default=500, help="events per Kafka message")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--window-s", type=float, default=1.0)
    ap.add_argument("--keep-up-s", type=float, default=5.0,
                    help="a step keeps up when events_in reaches the acked count within this many s after stop")
    ap.add_argument("--max-lag-growth", type=float, default=0.1,
                    help="a step fails when the backlog grows faster than this fraction of the rate (fitted slope)")
    ap.add_argument("--abort-lag-s", type=float, default=8.0,
                    help="stop a step's production once the worker is this many seconds of input behind")
    ap.add_argument("--max-drain-s", type=float, default=45.0, help="give up waiting for a backlog after this")
    ap.add_argument("--refine", type=int, default=1, help="midpoint steps between the last pass and first fail")
    ap.add_argument("--warmup-s", type=float, default=3.0, help="warm-up on each new worker (group join)")
    ap.add_argument("--bare-passes", type=int, default=2, help="bare-consumer reads of each step's messages (0: none)")
    ap.add_argument("--bare-cap-s", type=float, default=6.0, help="a bare read stops after this long")
    ap.add_argument("--no-sections", action="store_true", help="skip the in-process section timing")
    ap.add_argument("--no-fetch-probe", action="store_true", help="skip the aiokafka fetch-wait latency probe")
    ap.add_argument("--budget-s", type=float, default=270.0, help="no new step starts after this much time")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pipeline.json"))
    ap.add_argument("--keep-data", action="store_true", help="keep the temp data dirs (worker log, chDB)")
    ap.add_argument("--shared-broker", action="store_true",
                    help="one broker and worker for all steps (tansu's reads then slow down as the topic grows)")
    diag = ap.add_mutually_exclusive_group()
    diag.add_argument("--profile-worker", metavar="PATH",
                      help="run the worker under cProfile and write its profile here (slows it: diagnosis only)")
    diag.add_argument("--what-if-fetch-wait-ms", type=int, metavar="MS",
                      help="run the worker with aiokafka fetch_max_wait_ms=MS instead of Faust's 1500 (diagnosis only)")
    return ap.parse_args(argv)


def choose_steps(args, rates, run_step_at) -> tuple[list[dict], bool]:
    """Step up until a step fails; then, once per --refine, try the geometric midpoint."""
    steps: list[dict] = []
    queue = list(rates)
    refine_left = args.refine
    last_pass = None
    out_of_time = False
    while queue:
        rate = queue.pop(0)
        if time.monotonic() - T0 > args.budget_s:
            log(f"time budget of {args.budget_s:.0f}s spent: no step at {rate:,.0f}/s")
            out_of_time = True
            break
        step = run_step_at(len(steps) + 1, rate)
        steps.append(step)
        if step["sustained"]:
            last_pass = step
            if step["producer_limited"]:  # the producer, not the pipeline, fell short: stop here
                log("the producer could not reach the target: stopping the steps")
                break
            continue
        drained = step["all_rows_stored_after_stop_s"] is not None
        if refine_left and last_pass is not None and drained:
            refine_left -= 1
            mid = round((last_pass["target_events_per_s"] * rate) ** 0.5, -3)
            if last_pass["target_events_per_s"] < mid < rate:
                queue = [mid]
                log(f"refining: one step at {mid:,.0f}/s")
                continue
        queue = []
    return steps, out_of_time


def summarise(result: dict, steps: list[dict]) -> None:
    passed = [s for s in steps if s["sustained"]]
    best = max(passed, key=lambda s: s["produced_events_per_s"]) if passed else None
    failed = [s for s in steps if not s["sustained"]]
    result["sustained_events_per_s"] = best["produced_events_per_s"] if best else None
    result["sustained_step"] = best["label"] if best else None
    result["lowest_failing_target_events_per_s"] = min((s["target_events_per_s"] for s in failed), default=None)
    result["worker_max_events_per_s_observed_1s"] = max((s["worker_events_per_s_1s_max"] or 0 for s in steps),
                                                        default=None)
    ratio = best.get("ratio_to_bare_consumer") if best else None
    result["bare_consumer_events_per_s"] = best["bare_consumer"]["events_per_s_best"] if best and "bare_consumer" in best else None
    result["ratio_to_bare_consumer"] = ratio
    goals = {"zero_loss_at_sustained_rate": False, "ratio_to_bare_consumer_ge_0_5": False,
             "p99_event_to_raw_row_le_3s": False, "p99_event_to_feature_row_worst_case_le_3s": False}
    if best:
        lat = best["latency"]
        raw = lat["event_to_raw_row_ms"] or {}
        steady = (lat.get("features") or {}).get("steady") or {}
        feat_end = steady.get("window_end_to_feature_row_ms") or {}
        feat_start = steady.get("event_at_window_start_to_feature_row_ms") or {}
        result["at_sustained_rate"] = {
            "events_per_s": best["produced_events_per_s"],
            "event_to_raw_row_ms": raw or None,
            "event_to_feature_row_ms_event_at_window_end": feat_end or None,
            "event_to_feature_row_ms_event_at_window_start_worst_case": feat_start or None,
            "resources": best["resources"]}
        goals = {"zero_loss_at_sustained_rate": best["zero_loss"],
                 "ratio_to_bare_consumer_ge_0_5": ratio is not None and ratio >= GOAL_RATIO,
                 "p99_event_to_raw_row_le_3s": raw.get("p99") is not None and raw["p99"] <= GOAL_P99_S * 1000,
                 "p99_event_to_feature_row_worst_case_le_3s": (feat_start.get("p99") is not None
                                                               and feat_start["p99"] <= GOAL_P99_S * 1000)}
    meets_latency = [s for s in passed if (s["latency"]["event_to_raw_row_ms"] or {}).get("p99", 1e12)
                     <= GOAL_P99_S * 1000]
    result["highest_sustained_rate_with_raw_p99_le_3s"] = max(
        (s["produced_events_per_s"] for s in meets_latency), default=None)
    result["goals_met"] = goals


class Stack:
    """One broker, its topics, the launcher's sink and streams worker with their own chDB, and the bench's clients."""

    def __init__(self, args, run_id: str, tag: str):
        self.args, self.run_id, self.tag = args, run_id, tag
        self.data_dir = Path(tempfile.mkdtemp(prefix=f"fs-pipeline-bench-{tag}-"))
        self.env = {**os.environ, "FLEETSCOPE_DATA_DIR": str(self.data_dir),
                    "FLEETSCOPE_TOPIC_PREFIX": f"{run_id}{tag}", "FLEETSCOPE_CONSUMER_GROUP": f"{run_id}{tag}-streams",
                    "FLEETSCOPE_PARTITIONS": str(args.partitions), "FLEETSCOPE_WINDOW_S": str(args.window_s)}
        for var in ("FLEETSCOPE_ALLOWED_LATENESS_S", "FLEETSCOPE_IDLE_CLOSE_S", "FLEETSCOPE_CONFIG",
                    "FLEETSCOPE_CLICKHOUSE_URL", "FLEETSCOPE_DATABASE", "FLEETSCOPE_KAFKA"):
            self.env.pop(var, None)  # the shipped defaults, the embedded broker and store
        self.stack = self.broker = self.worker = self.producer = self.lag_probe = None

    def start(self) -> "Stack":
        self.stack = EmbeddedStack(config_mod.load(env=self.env), workers=1, env=self.env,
                                   worker_argv=Worker.argv(self.args.profile_worker, self.args.what_if_fetch_wait_ms))
        self.stack.start()
        self.cfg, self.broker = self.stack.cfg, self.stack.broker
        self.topic = self.cfg.raw_topic("host")
        self.probe_topic = f"{self.cfg.topic_prefix}.bench-probe"  # never a raw topic: the worker would dead-letter it
        ensure_topics(self.broker.bootstrap, [self.probe_topic], self.cfg.partitions)
        self.worker = Worker(self.stack)
        self.lag_probe = CommittedLag(self.broker.bootstrap, self.cfg.consumer_group, self.topic, self.cfg.partitions)
        self.producer = make_producer(self.broker.bootstrap)
        stack, broker = self.stack, self.broker
        self.probes = [ProcProbe("worker", lambda: group_pids(stack.workers[0].pid)),
                       ProcProbe("sink", lambda: group_pids(stack.sink.pid)),
                       ProcProbe("broker", lambda: [broker.pid]),
                       ProcProbe("bench_producer", lambda: [os.getpid()])]
        log(f"[{self.tag}] broker on {self.broker.bootstrap} (pid {self.broker.pid}), worker pid "
            f"{stack.workers[0].pid}, sink pid {stack.sink.pid}, data dir {self.data_dir}")
        return self

    def stop(self) -> None:
        if self.lag_probe is not None:
            self.lag_probe.close()
            self.lag_probe = None
        if self.producer is not None:
            self.producer.flush(5)
            self.producer = None  # its threads would keep dialling the stopped broker
        if self.stack is not None:
            self.stack.stop()
        if not self.args.keep_data:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        else:
            log(f"kept {self.data_dir}")


def measure_step(args, stack: Stack, idx: int, rate: float, duration_s: float, label: str) -> dict:
    """One step on a stack, then the bare consumer on the same messages (worker idle)."""
    step = run_step(args, idx, rate, duration_s, stack.run_id + stack.tag, stack.topic, stack.producer,
                    stack.worker, stack.probes, stack.lag_probe, label)
    start, end = step.pop("_offsets")
    if args.bare_passes and len(start) == len(end) == stack.cfg.partitions:
        step["bare_consumer"] = bare = bare_consume(stack.broker.bootstrap, stack.topic, start, end,
                                                    args.events_per_batch, args.bare_passes, args.bare_cap_s)
        step["messages_in_topic_after_step"] = sum(end)
        step["ratio_to_bare_consumer"] = (round(step["produced_events_per_s"] / bare["events_per_s_best"], 4)
                                          if bare["events_per_s_best"] else None)
        log(f"{label}: bare consumer read its {bare['messages_in_range']:,} messages at "
            f"{bare['events_per_s_best']:,} events/s (best of {args.bare_passes}); ratio {step['ratio_to_bare_consumer']}")
    return step


def finish_step(args, stack: Stack, step: dict, wait_tail: bool) -> None:
    """Feature latencies for a step; with wait_tail, after the idle timer closed its last windows."""
    if wait_tail:
        time.sleep(max(0.0, step["_stopped_at"] + args.idle_close_s + 2.0 - time.monotonic()))
    step["latency"]["features"] = feature_latency(stack.worker, step["job_prefix"], step.pop("_steady_cut_ms"))
    step.pop("_stopped_at")


def main(argv=None) -> int:
    args = parse_args(argv)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    run_id = f"pb{uuid.uuid4().hex[:6]}"
    defaults = config_mod.load(env={})
    args.lateness_s, args.idle_close_s = defaults.allowed_lateness_s, defaults.idle_close_s
    stacks: list[Stack] = []
    shared: Stack | None = None

    def on_term(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)

    result: dict = {"benchmark": "pipeline", "command": " ".join(["python", *sys.argv]),
                    "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "machine": {"nproc": os.cpu_count(), "sched_affinity_cpus": len(os.sched_getaffinity(0)),
                                "python": platform.python_version(), "loadavg_at_start": list(os.getloadavg())},
                    "code_at_start": code_state(),
                    "goals": {"loss_events": 0, "ratio_to_bare_consumer_min": GOAL_RATIO,
                              "p99_event_to_row_s_max": GOAL_P99_S},
                    "config": {"hosts": args.hosts, "events_per_batch": args.events_per_batch,
                               "bytes_per_message": len(encode(Fleet("x", 1, args.events_per_batch).next_batch())),
                               "partitions": args.partitions, "window_s": args.window_s,
                               "allowed_lateness_s": args.lateness_s, "idle_close_s": args.idle_close_s,
                               "step_s": args.step_s, "warmup_s": args.warmup_s, "keep_up_s": args.keep_up_s,
                               "abort_lag_s": args.abort_lag_s, "max_lag_growth_fraction_of_rate": args.max_lag_growth,
                               "rates": rates, "fresh_broker_and_worker_per_step": not args.shared_broker,
                               "worker_profiled": bool(args.profile_worker),
                               "worker_fetch_max_wait_ms": args.what_if_fetch_wait_ms or "faust default (1500)",
                               "broker": "tansu (EmbeddedBroker, memory storage, loopback)",
                               "producer": "confluent-kafka, acks=all, idempotent, linger.ms=5, in the bench process"}}

    def new_stack(tag: str) -> Stack:
        stack = Stack(args, run_id, tag)
        stacks.append(stack)
        stack.start()
        # warm-up: the consumer group joins and the first store look-ups happen before anything is timed
        warm = measure_step(args, stack, 0, 10_000, args.warmup_s, f"[{tag}] warmup")
        finish_step(args, stack, warm, wait_tail=False)
        result.setdefault("warmups", []).append(
            {k: warm[k] for k in ("label", "produced_events_per_s", "events_acked", "raw_rows", "loss_events",
                                  "caught_up_after_stop_s")})
        return stack

    try:
        if args.shared_broker:
            shared = new_stack("shared")

        def run_step_at(idx: int, rate: float) -> dict:
            stack = shared
            if stack is None:  # a fresh broker and worker: tansu's reads slow down as its partitions grow
                for old in stacks:
                    old.stop()
                stack = new_stack(f"s{idx}")
            step = measure_step(args, stack, idx, rate, args.step_s, f"step {idx}")
            if shared is None:
                finish_step(args, stack, step, wait_tail=False)
            else:
                step["_stack"] = stack
            return step

        steps, result["stopped_by_budget"] = choose_steps(args, rates, run_step_at)
        last = stacks[-1]
        # the last worker: its tail windows close on the idle timer, then every offset must be committed
        for i, step in enumerate(steps):
            if "_stopped_at" in step:
                finish_step(args, step.pop("_stack", last), step, wait_tail=(i == len(steps) - 1))
        deadline = time.monotonic() + args.idle_close_s + 10
        while last.lag_probe.lag() not in (0, None) and time.monotonic() < deadline:
            time.sleep(0.5)
        result["end_of_run"] = {"stack": last.tag, "committed_lag_messages": last.lag_probe.lag(),
                                "committed_offsets": last.lag_probe.partitions(), "worker_stats": last.worker.stats()}
        result["steps"] = steps
        summarise(result, steps)
        if not args.no_fetch_probe:
            result["fetch_wait_probe"] = fetch_wait_probe(last.broker.bootstrap, last.probe_topic, last.producer)
            log(f"fetch-wait probe (aiokafka produce->receive): {result['fetch_wait_probe']}")
        result["worker_log_errors"] = [line for stack in stacks[-1:] for line in stack.worker.tail(20000).splitlines()
                                       if "ERROR" in line or "Traceback" in line][-10:]
    finally:
        for stack in stacks:
            stack.stop()
        log("workers and brokers stopped")
    if not args.no_sections:
        best = next((s for s in result["steps"] if s["label"] == result.get("sustained_step")), None)
        rate = best["produced_events_per_s"] if best else 20_000
        flush_events = best["flush_events_mean"] if best else 5_000
        log(f"section timing in this process: the fleet at {rate:,}/s, {flush_events:,} events per insert")
        result["sections"] = section_timings(args, rate, flush_events)
        log(f"sections: {json.dumps(result['sections'])}")
    result["code_at_end"] = code_state()
    result["code_changed_during_run"] = result["code_at_end"] != result["code_at_start"]
    if result["code_changed_during_run"]:
        log("WARNING: the code outside benchmarks/ changed during this run; its numbers mix two versions")
    result["elapsed_s"] = round(time.monotonic() - T0, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"sustained {result['sustained_events_per_s']} events/s; bare consumer on the same messages "
        f"{result['bare_consumer_events_per_s']} events/s; ratio {result['ratio_to_bare_consumer']}; "
        f"goals {result['goals_met']}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
