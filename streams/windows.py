"""Event-time tumbling windows over metric batches, aggregated with numpy.

A window is keyed by (tenant, job, host, rank, window_start). It closes when
the newest event time seen for its (tenant, job, host, rank) passes
window_end + allowed lateness, or, for a key that stopped sending, after
`idle_close_s` of wall time. The wall clock never decides which window an
event belongs to; it only flushes windows nobody will add to.

Each window remembers which messages fed it, so a message is acknowledged
(and its offset committed) only once every window it touched is stored.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from fleetscope.wire import Batch

StreamKey = tuple[str, str, str, int]  # tenant, job, host, rank


@dataclass
class MetricAgg:
    """Per (metric, device): deltas summed, gauges' last value and mean."""

    delta_sum: float = 0.0
    interval_ns: int = 0
    gauge_last: float = float("nan")
    gauge_sum: float = 0.0
    gauge_n: int = 0
    last_ts: int = -1


@dataclass
class Window:
    key: StreamKey
    start_ns: int
    end_ns: int
    metrics: dict[tuple[str, str, str], MetricAgg] = field(default_factory=dict)  # (source, metric, device)
    sources: set[str] = field(default_factory=set)
    event_count: int = 0
    messages: list = field(default_factory=list)  # message refs that fed this window


@dataclass
class WindowStats:
    windows_closed: int = 0
    late_events: int = 0  # arrived after their window closed: counted, dropped
    replayed_events: int = 0  # for windows already stored before a restart


class WindowAssembler:
    def __init__(self, window_s: float, allowed_lateness_s: float, idle_close_s: float,
                 stored_marks=None, clock=time.monotonic):
        self.window_ns = int(window_s * 1e9)
        self.lateness_ns = int(allowed_lateness_s * 1e9)
        self.idle_close_s = idle_close_s
        self.stored_marks = stored_marks  # key -> last stored window_start_ns (or None)
        self.clock = clock
        self.open: dict[tuple[StreamKey, int], Window] = {}
        self.max_ts: dict[StreamKey, int] = {}
        self.closed_upto: dict[StreamKey, int] = {}  # newest window start this process closed
        self.stored_upto: dict[StreamKey, int] = {}  # newest window start the store had at first sight
        self.last_seen: dict[StreamKey, float] = {}
        self.stats = WindowStats()

    def _stored_mark(self, key: StreamKey) -> int:
        if key not in self.stored_upto:
            mark = self.stored_marks(key) if self.stored_marks else None
            self.stored_upto[key] = -1 if mark is None else int(mark)
        return self.stored_upto[key]

    def add(self, batch: Batch, message_ref) -> list[Window]:
        """Fold a decoded metric batch in. Returns the windows it touched."""
        cols = batch.columns
        ts = cols["ts_ns"]
        win = ts // self.window_ns
        tenant, job, rank = cols["tenant"], cols["job"], cols["rank"]
        metric, device, value, interval = cols["metric"], cols["device"], cols["value"], cols["interval_ns"]
        # group rows by (tenant, job, rank, window): one np.unique over a structured key
        group = np.empty(len(ts), dtype=[("t", "<u4"), ("j", "<u4"), ("r", "<i4"), ("w", "<i8")])
        group["t"], group["j"], group["r"], group["w"] = tenant.codes, job.codes, rank, win
        uniq, inverse = np.unique(group, return_inverse=True)
        touched = []
        now = self.clock()
        for g, (t, j, r, w) in enumerate(uniq.tolist()):
            key = (tenant.values[t], job.values[j], batch.host, int(r))
            rows = np.nonzero(inverse == g)[0] if len(uniq) > 1 else slice(None)
            start = int(w) * self.window_ns
            n = len(ts[rows])
            self.last_seen[key] = now
            group_max = int(ts[rows].max())
            if group_max > self.max_ts.get(key, -1):
                self.max_ts[key] = group_max
            if start <= self._stored_mark(key):  # stored before a restart: replay, not loss
                self.stats.replayed_events += n
                continue
            if start <= self.closed_upto.get(key, -1):
                self.stats.late_events += n
                continue
            window = self.open.get((key, start))
            if window is None:
                window = self.open[(key, start)] = Window(key, start, start + self.window_ns)
            window.sources.add(batch.source)
            window.event_count += n
            if not window.messages or window.messages[-1] is not message_ref:
                window.messages.append(message_ref)
            self._fold(window, batch.source, metric, device, value, interval, ts, rows)
            touched.append(window)
        return touched

    @staticmethod
    def _fold(window: Window, source, metric, device, value, interval, ts, rows) -> None:
        m_codes, d_codes = metric.codes[rows], device.codes[rows]
        vals, ivs, tss = value[rows], interval[rows], ts[rows]
        pair = m_codes.astype(np.uint64) << np.uint64(32) | d_codes.astype(np.uint64)
        order = np.argsort(pair, kind="stable")
        pair_sorted = pair[order]
        bounds = np.flatnonzero(np.diff(pair_sorted)) + 1
        starts = np.concatenate(([0], bounds))
        is_delta = ivs[order] > 0
        v_sorted, iv_sorted, ts_sorted = vals[order], ivs[order], tss[order]
        delta_sum = np.add.reduceat(np.where(is_delta, v_sorted, 0.0), starts)
        iv_sum = np.add.reduceat(np.where(is_delta, iv_sorted, 0), starts)
        g_sum = np.add.reduceat(np.where(is_delta, 0.0, v_sorted), starts)
        g_n = np.add.reduceat((~is_delta).astype(np.int64), starts)
        ends = np.concatenate((bounds, [len(pair_sorted)])) - 1
        for i, s in enumerate(starts.tolist()):
            p = int(pair_sorted[s])
            k = (source, metric.values[p >> 32], device.values[p & 0xFFFFFFFF])
            agg = window.metrics.get(k)
            if agg is None:
                agg = window.metrics[k] = MetricAgg()
            agg.delta_sum += float(delta_sum[i])
            agg.interval_ns += int(iv_sum[i])
            if g_n[i]:
                agg.gauge_sum += float(g_sum[i])
                agg.gauge_n += int(g_n[i])
                last = int(ends[i])
                if int(ts_sorted[last]) >= agg.last_ts:
                    agg.gauge_last, agg.last_ts = float(v_sorted[last]), int(ts_sorted[last])

    def pop_closed(self, force: bool = False) -> list[Window]:
        """Windows whose key's watermark passed end + lateness, or idle keys' windows."""
        now = self.clock()
        closed = []
        for (key, start), window in list(self.open.items()):
            watermark = self.max_ts.get(key, -1) - self.lateness_ns
            idle = now - self.last_seen.get(key, now) >= self.idle_close_s
            if force or idle or window.end_ns <= watermark:
                closed.append(self.open.pop((key, start)))
        closed.sort(key=lambda w: (w.key, w.start_ns))
        for window in closed:
            if window.start_ns > self.closed_upto.get(window.key, -1):
                self.closed_upto[window.key] = window.start_ns
        self.stats.windows_closed += len(closed)
        return closed
