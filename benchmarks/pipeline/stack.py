"""One embedded stack for a phase of the bench: the launcher's broker, sink and N workers
(fleetscope.cli.launcher.EmbeddedStack) with their own data dir, topic prefix and consumer
group, the bench's producer, and the store's views the bench asks for (rows, latencies)."""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from fleetscope import config as config_mod
from fleetscope.cli.launcher import EmbeddedStack
from fleetscope.schema import NODE_TENANT

from pipeline.fleet import make_producer
from pipeline.probes import CommittedLag, ProcProbe, group_pids

T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


class BenchStack:
    def __init__(self, args, run_id: str, tag: str, workers: int = 1):
        self.args, self.tag, self.n_workers = args, tag, workers
        self.prefix = f"{run_id}{tag}"
        self.data_dir = Path(tempfile.mkdtemp(prefix=f"fs-pipeline-bench-{tag}-"))
        self.env = {**os.environ, "FLEETSCOPE_DATA_DIR": str(self.data_dir),
                    "FLEETSCOPE_TOPIC_PREFIX": self.prefix, "FLEETSCOPE_CONSUMER_GROUP": f"{self.prefix}-streams",
                    "FLEETSCOPE_PARTITIONS": str(args.partitions), "FLEETSCOPE_WINDOW_S": str(args.window_s)}
        for var in ("FLEETSCOPE_ALLOWED_LATENESS_S", "FLEETSCOPE_IDLE_CLOSE_S", "FLEETSCOPE_CONFIG",
                    "FLEETSCOPE_CLICKHOUSE_URL", "FLEETSCOPE_DATABASE", "FLEETSCOPE_KAFKA"):
            self.env.pop(var, None)  # the shipped defaults, the embedded broker and store
        self.stack = self.producer = self.lag_probe = None

    def start(self) -> "BenchStack":
        argv = None
        if self.args.profile_worker:  # cProfile of the worker's main thread, written when it stops
            argv = [os.sys.executable, "-m", "cProfile", "-o", f"{self.args.profile_worker}.{self.tag}",
                    "-m", "fleetscope", "streams"]
        self.stack = EmbeddedStack(config_mod.load(env=self.env), workers=self.n_workers, env=self.env,
                                   worker_argv=argv)
        self.stack.start()
        self.cfg, self.broker = self.stack.cfg, self.stack.broker
        self.topic = self.cfg.raw_topic("host")
        self.lag_probe = CommittedLag(self.broker.bootstrap, self.cfg.consumer_group, self.topic, self.cfg.partitions)
        self.producer = make_producer(self.broker.bootstrap)
        log(f"[{self.tag}] broker {self.broker.bootstrap} (pid {self.broker.pid}), workers "
            f"{[w.pid for w in self.stack.workers]}, sink pid {self.stack.sink.pid}, data dir {self.data_dir}")
        return self

    def probes(self) -> list[ProcProbe]:
        st, broker = self.stack, self.broker
        out = [ProcProbe(f"worker{i}" if i else "worker", lambda w=w: group_pids(w.pid) if w.alive() else [])
               for i, w in enumerate(st.workers)]
        return out + [ProcProbe("sink", lambda: group_pids(st.sink.pid) if st.sink.alive() else []),
                      ProcProbe("broker", lambda: [broker.pid]), ProcProbe("bench", lambda: [os.getpid()])]

    # -- counters and rows ----------------------------------------------------------------------------------

    def events_in(self) -> int:
        self.stack.check()
        s = self.stack.worker_stats()
        return 0 if s is None else int(s.get("events_in", 0))

    def sink_raw_rows(self) -> int:
        self.stack.check()
        s = self.stack.sink_stats()
        return 0 if s is None else int(s.get("sink_raw_rows", 0))

    def query(self, sql: str, params: dict | None = None) -> list[tuple]:
        return self.stack.query(sql, params).rows

    def raw_rows(self, job_prefix: str) -> int:
        return int(self.query("SELECT count() FROM raw_metrics WHERE tenant = {t:String} AND startsWith(job, {p:String})",
                              {"t": NODE_TENANT, "p": job_prefix})[0][0])

    def feature_events(self, job_prefix: str) -> tuple[int, int]:
        """(windows, summed event_count) of the stored feature rows of these hosts (FINAL: one row a window)."""
        n, events = self.query("SELECT count(), sum(event_count) FROM features FINAL WHERE tenant = {t:String} "
                               "AND startsWith(job, {p:String})", {"t": NODE_TENANT, "p": job_prefix})[0]
        return int(n), int(events or 0)

    def raw_latency(self, job_prefix: str) -> dict:
        rows = self.query(
            "SELECT count(), quantilesExact(0.5, 0.9, 0.99, 1)(toUnixTimestamp64Milli(ingested_at) "
            "- intDiv(toUnixTimestamp64Nano(ts), 1000000)) "
            "FROM raw_metrics WHERE tenant = {t:String} AND startsWith(job, {p:String})",
            {"t": NODE_TENANT, "p": job_prefix})
        count, q = rows[0]
        return {"rows": int(count),
                "event_to_raw_row_ms": dict(zip(("p50", "p90", "p99", "max"), map(int, q))) if count else None}

    def feature_latency(self, job_prefix: str, steady_cut_ms: int) -> dict:
        """Windows closed by the watermark while the step ran: emitted_at - window_end (an event at the
        window's end) and emitted_at - window_start (the worst case, an event at its start)."""
        n, q_end, q_start = self.query(
            "SELECT count(), "
            "quantilesExact(0.5, 0.99, 1)(toUnixTimestamp64Milli(emitted_at) - toUnixTimestamp64Milli(window_end)), "
            "quantilesExact(0.5, 0.99, 1)(toUnixTimestamp64Milli(emitted_at) - toUnixTimestamp64Milli(window_start)) "
            "FROM features WHERE tenant = {t:String} AND startsWith(job, {p:String}) "
            "AND toUnixTimestamp64Milli(window_end) <= {cut:Int64}",
            {"t": NODE_TENANT, "p": job_prefix, "cut": steady_cut_ms})[0]
        keys = ("p50", "p99", "max")
        return {"windows": int(n),
                "window_end_to_feature_row_ms": dict(zip(keys, map(int, q_end))) if n else None,
                "event_at_window_start_to_feature_row_ms": dict(zip(keys, map(int, q_start))) if n else None}

    def wait_idle(self, timeout_s: float) -> dict:
        """Until the workers hold no open window and no unacknowledged message, and the sink's group has
        committed everything; returns what was reached."""
        deadline = time.monotonic() + timeout_s
        st = self.stack
        while time.monotonic() < deadline:
            w = st.worker_stats() or {}
            workers_idle = all(not x.alive() for x in st.workers) or (
                w.get("open_windows") == 0 and w.get("unacked_messages") == 0)
            sink_up = st.sink is not None and st.sink.alive()
            sink_lag = st.sink_lag() if sink_up else None
            if workers_idle and (not sink_up or sink_lag == 0):
                return {"idle": True, "sink_lag": sink_lag}
            time.sleep(0.5)
        return {"idle": False, "worker_stats": st.worker_stats(), "sink_lag": st.sink_lag()}

    def stop(self) -> None:
        if self.lag_probe is not None:
            self.lag_probe.close()
            self.lag_probe = None
        if self.producer is not None:
            self.producer.flush(5)
            self.producer = None  # its threads would keep dialling the stopped broker
        if self.stack is not None:
            self.stack.stop()
            self.stack = None
        if not self.args.keep_data:
            shutil.rmtree(self.data_dir, ignore_errors=True)


def follow(read, target: int, timeout_s: float, poll_s: float = 0.2, start: float | None = None) -> dict:
    """Poll a counter until it reaches target. The rate is the slope of a line fitted to the samples between
    10% and 90% of the target (start-up and the last partial poll excluded), else target over the time from
    the last zero sample to the first at target."""
    start = time.monotonic() if start is None else start
    samples: list[tuple[float, int]] = []
    deadline = start + timeout_s
    while True:
        v = read()
        samples.append((time.monotonic() - start, v))
        if v >= target or time.monotonic() > deadline:
            break
        time.sleep(poll_s)
    done = samples[-1][1] >= target
    mid = [(t, v) for t, v in samples if 0.1 * target <= v <= 0.9 * target]
    # a counter written once a second repeats; keep each value's first sample
    firsts = [s for i, s in enumerate(mid) if i == 0 or s[1] != mid[i - 1][1]]
    rate = None
    if len(firsts) >= 3:
        rate = float(np.polyfit([t for t, _ in firsts], [v for _, v in firsts], 1)[0])
    elif done:
        t_zero = max((t for t, v in samples if v == 0), default=0.0)
        rate = target / max(samples[-1][0] - t_zero, 1e-9)
    return {"reached": done, "value": samples[-1][1], "target": target, "seconds": round(samples[-1][0], 2),
            "events_per_s": None if rate is None else round(rate), "fit_points": len(firsts),
            "timeline": [(round(t, 2), v) for t, v in samples[:: max(1, len(samples) // 60)]]}
