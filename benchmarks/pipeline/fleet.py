"""The synthetic fleet (big hosts' `host`-source batches) and the bench's producers:
paced in wall time (a live fleet) or as a backlog whose event times are spread as a
live fleet at a given rate would have stamped them."""
from __future__ import annotations

import time

import numpy as np

from fleetscope.schema import NODE_TENANT, SOURCE_COLUMNS, node_identity
from fleetscope.wire import Batch, StrColumn, encode

CPU_STATES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
NODE_METRICS = (("mem.total", 0), ("mem.available", 0), ("mem.anon", 0), ("mem.anon_huge", 0),
                ("vm.pgfault", 1), ("vm.pgmajfault", 1), ("vm.numa_hit", 1), ("vm.numa_miss", 1),
                ("cpu.context_switches", 1), ("irq.cpu_total", 1))


def metric_catalogue(n: int):
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
    """Synthetic hosts; each batch is one sample tick of one host. Every host is its own job key
    (node load), so each step's rows are found by its host-name prefix."""

    def __init__(self, prefix: str, n_hosts: int, events_per_batch: int, seed: int = 7):
        self.prefix = prefix
        self.hosts = [f"{prefix}{i:02d}" for i in range(n_hosts)]
        self.n = events_per_batch
        m_codes, metrics, d_codes, devices, is_delta = metric_catalogue(events_per_batch)
        self.metric, self.device = StrColumn(m_codes, metrics), StrColumn(d_codes, devices)
        self.rng = np.random.default_rng(seed)
        self.values = self.rng.random((64, self.n)) * 1e6  # a few value sets, reused
        self.identity = {h: node_identity(h, self.n) for h in self.hosts}
        self.last_ts = {h: 0 for h in self.hosts}
        self.is_delta = is_delta
        self._i = 0

    def next_batch(self, ts: int | None = None) -> Batch:
        """The next host's tick, stamped `ts` (default: now), strictly increasing per host."""
        host = self.hosts[self._i % len(self.hosts)]
        ts = time.time_ns() if ts is None else ts
        prev = self.last_ts[host] or ts - 10**9
        ts = max(ts, prev + 1)  # unique sort keys per host
        self.last_ts[host] = ts
        cols = {"ts_ns": np.full(self.n, ts, dtype="<i8"), **self.identity[host],
                "metric": self.metric, "device": self.device,
                "value": self.values[self._i % len(self.values)],
                "interval_ns": np.where(self.is_delta, ts - prev, 0).astype("<i8")}
        self._i += 1
        assert set(cols) == set(SOURCE_COLUMNS["host"])
        return Batch("host", host, cols, created_ns=ts)


def make_producer(bootstrap: str):
    from confluent_kafka import Producer
    return Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True,
                     "linger.ms": 5, "queue.buffering.max.messages": 100_000,
                     "client.id": "pipeline-bench", "log.connection.close": False})


class Delivery:
    def __init__(self):
        self.events = self.messages = self.errors = self.bytes = 0

    def callback(self, count: int, size: int):
        def done(err, _msg):
            if err is None:
                self.events += count
                self.messages += 1
                self.bytes += size
            else:
                self.errors += 1
        return done


def _send(producer, topic: str, batch: Batch, delivery: Delivery) -> int:
    value = encode(batch)
    while True:
        try:
            producer.produce(topic, key=f"{NODE_TENANT}/{batch.host}".encode(), value=value,
                             headers=batch.kafka_headers(), on_delivery=delivery.callback(batch.count, len(value)))
            return len(value)
        except BufferError:
            producer.poll(0.01)


def produce_paced(producer, topic: str, fleet: Fleet, rate: float, duration_s: float, tick) -> dict:
    """Produce `rate` events/s for duration_s, stamped with the wall clock; tick(elapsed, enqueued)
    runs about once a second and may return True to stop early (the pipeline fell too far behind)."""
    delivery = Delivery()
    enqueued = 0
    aborted = False
    start = time.monotonic()
    next_tick = 1.0
    while True:
        elapsed = time.monotonic() - start
        if elapsed >= duration_s:
            break
        due = int(rate * elapsed) - enqueued
        while due >= fleet.n:
            _send(producer, topic, fleet.next_batch(), delivery)
            enqueued += fleet.n
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
    return {"delivery": delivery, "enqueued": enqueued, "produce_s": produce_s, "aborted": aborted,
            "unflushed": unflushed, "stopped_at_wall_ns": stopped_at_wall_ns, "stopped_at": stopped_at}


def produce_backlog(producer, topic: str, fleet: Fleet, n_events: int, density_events_per_s: float) -> dict:
    """n_events as fast as the producer goes, with event times spread as a live fleet at
    density_events_per_s would have stamped them, ending now: a backlog whose windows hold
    as many events as the live fleet's at that rate."""
    delivery = Delivery()
    n_batches = max(1, n_events // fleet.n)
    step_ns = int(fleet.n / density_events_per_s * 1e9)
    first_ts = time.time_ns() - n_batches * step_ns
    t0 = time.monotonic()
    for i in range(n_batches):
        _send(producer, topic, fleet.next_batch(first_ts + i * step_ns), delivery)
        if i % 64 == 0:
            producer.poll(0)
    unflushed = producer.flush(120)
    return {"delivery": delivery, "batches": n_batches, "events": n_batches * fleet.n,
            "produce_s": round(time.monotonic() - t0, 2), "unflushed": unflushed,
            "event_time_span_s": round(n_batches * step_ns / 1e9, 2)}
