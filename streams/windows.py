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
from streams.series import Interner, KeySeries, series_code, split_code

StreamKey = tuple[str, str, str, int]  # tenant, job, host, rank


@dataclass
class MetricAgg:
    """One series in one window: deltas summed, gauges' last value and mean."""

    delta_sum: float
    interval_ns: int
    gauge_last: float
    gauge_sum: float
    gauge_n: int


class Window:
    def __init__(self, key: StreamKey, start_ns: int, end_ns: int, series: KeySeries, names: Interner):
        self.key, self.start_ns, self.end_ns = key, start_ns, end_ns
        self.series, self.names = series, names
        self.sources: set[str] = set()
        self.event_count = 0
        self.messages: list = []  # message refs that fed this window
        self.delta_sum = np.zeros(0)
        self.interval_ns = np.zeros(0)
        self.gauge_sum = np.zeros(0)
        self.gauge_n = np.zeros(0, dtype=np.int64)
        self.gauge_last = np.zeros(0)
        self.last_ts = np.zeros(0, dtype=np.int64)

    def _grow(self, n: int) -> None:
        old = len(self.delta_sum)
        if n <= old:
            return
        pad = n - old
        self.delta_sum = np.concatenate([self.delta_sum, np.zeros(pad)])
        self.interval_ns = np.concatenate([self.interval_ns, np.zeros(pad)])
        self.gauge_sum = np.concatenate([self.gauge_sum, np.zeros(pad)])
        self.gauge_n = np.concatenate([self.gauge_n, np.zeros(pad, dtype=np.int64)])
        self.gauge_last = np.concatenate([self.gauge_last, np.full(pad, np.nan)])
        self.last_ts = np.concatenate([self.last_ts, np.full(pad, -1, dtype=np.int64)])

    def fold(self, local: np.ndarray, value: np.ndarray, interval: np.ndarray, ts: np.ndarray) -> None:
        n = self.series.n
        self._grow(n)
        delta = interval > 0
        if delta.any():
            self.delta_sum[:n] += np.bincount(local[delta], weights=value[delta], minlength=n)
            self.interval_ns[:n] += np.bincount(local[delta], weights=interval[delta], minlength=n)
        gauge = ~delta
        if gauge.any():
            g_local, g_val, g_ts = local[gauge], value[gauge], ts[gauge]
            self.gauge_sum[:n] += np.bincount(g_local, weights=g_val, minlength=n)
            self.gauge_n[:n] += np.bincount(g_local, minlength=n)
            order = np.argsort(g_ts, kind="stable")
            g_local, g_val, g_ts = g_local[order], g_val[order], g_ts[order]
            # the newest sample per series: first occurrence in the reversed, time-sorted rows
            uniq, first_rev = np.unique(g_local[::-1], return_index=True)
            last = len(g_local) - 1 - first_rev
            newer = g_ts[last] >= self.last_ts[uniq]
            self.gauge_last[uniq[newer]] = g_val[last][newer]
            self.last_ts[uniq[newer]] = g_ts[last][newer]

    def _agg(self, i: int) -> MetricAgg:
        return MetricAgg(float(self.delta_sum[i]), int(self.interval_ns[i]), float(self.gauge_last[i]),
                         float(self.gauge_sum[i]), int(self.gauge_n[i]))

    def agg(self, source: str, metric: str, device: str = "all") -> MetricAgg | None:
        """The series' aggregate in this window, or None if it sent nothing here."""
        ids = self.names.ids
        if source not in ids or metric not in ids or device not in ids:
            return None
        i = self.series.find(int(series_code(ids[source], np.int64(ids[metric]), np.int64(ids[device]))))
        if i is None or i >= len(self.delta_sum) or (self.interval_ns[i] == 0 and self.gauge_n[i] == 0):
            return None
        return self._agg(i)

    def devices(self, source: str, metric: str) -> list[tuple[str, MetricAgg]]:
        """Every device of one metric that sent something in this window."""
        ids = self.names.ids
        if source not in ids or metric not in ids:
            return []
        out = []
        for i in self.series.by_metric.get((ids[source], ids[metric]), ()):
            if i < len(self.delta_sum) and (self.interval_ns[i] > 0 or self.gauge_n[i] > 0):
                out.append((self.names.names[split_code(self.series.codes[i])[2]], self._agg(i)))
        return out


@dataclass
class WindowStats:
    windows_closed: int = 0
    late_events: int = 0  # arrived after their window closed: counted, dropped
    replayed_events: int = 0  # for windows already stored before a restart


@dataclass
class _KeyState:
    series: KeySeries = field(default_factory=KeySeries)
    max_ts: int = -1
    closed_upto: int = -1  # newest window start this process closed
    stored_upto: int | None = None  # newest window start the store had at first sight
    last_seen: float = 0.0


class WindowAssembler:
    def __init__(self, window_s: float, allowed_lateness_s: float, idle_close_s: float,
                 stored_marks=None, clock=time.monotonic):
        self.window_ns = int(window_s * 1e9)
        self.lateness_ns = int(allowed_lateness_s * 1e9)
        self.idle_close_s = idle_close_s
        self.stored_marks = stored_marks  # key -> last stored window_start_ns (or None)
        self.clock = clock
        self.names = Interner()
        self.keys: dict[StreamKey, _KeyState] = {}
        self.open: dict[tuple[StreamKey, int], Window] = {}
        self.stats = WindowStats()

    def _state(self, key: StreamKey) -> _KeyState:
        state = self.keys.get(key)
        if state is None:
            state = self.keys[key] = _KeyState()
            mark = self.stored_marks(key) if self.stored_marks else None
            state.stored_upto = -1 if mark is None else int(mark)
        return state

    def add(self, batch: Batch, message_ref) -> list[Window]:
        """Fold a decoded metric batch in. Returns the windows it touched."""
        cols = batch.columns
        ts, value, interval = cols["ts_ns"], cols["value"], cols["interval_ns"]
        tenant, job, rank = cols["tenant"], cols["job"], cols["rank"]
        if "sample_frac" in cols:
            value = scale_sampled(value, interval, cols["sample_frac"])
        metric, device = cols["metric"], cols["device"]
        codes = series_code(self.names.id(batch.source), self.names.ids_of(metric.values)[metric.codes],
                            self.names.ids_of(device.values)[device.codes])
        win = ts // self.window_ns
        touched = []
        now = self.clock()
        for (t, j, r, w), rows in _groups(tenant.codes, job.codes, rank, win):
            key = (tenant.values[t], job.values[j], batch.host, r)
            state = self._state(key)
            state.last_seen = now
            g_ts = ts[rows]
            state.max_ts = max(state.max_ts, int(g_ts.max()))
            start = w * self.window_ns
            if start <= state.stored_upto:  # stored before a restart: a replay, not a loss
                self.stats.replayed_events += len(g_ts)
                continue
            if start <= state.closed_upto:
                self.stats.late_events += len(g_ts)
                continue
            window = self.open.get((key, start))
            if window is None:
                window = self.open[(key, start)] = Window(key, start, start + self.window_ns, state.series, self.names)
            window.sources.add(batch.source)
            window.event_count += len(g_ts)
            window.messages.append(message_ref)
            window.fold(state.series.local(codes[rows]), value[rows], interval[rows], g_ts)
            touched.append(window)
        return touched

    def pop_closed(self, force: bool = False) -> list[Window]:
        """Windows whose key's watermark passed end + lateness, or idle keys' windows."""
        now = self.clock()
        closed = []
        for (key, start), window in list(self.open.items()):
            state = self.keys[key]
            idle = now - state.last_seen >= self.idle_close_s
            if force or idle or window.end_ns <= state.max_ts - self.lateness_ns:
                closed.append(self.open.pop((key, start)))
        closed.sort(key=lambda w: (w.key, w.start_ns))
        for window in closed:
            state = self.keys[window.key]
            state.closed_upto = max(state.closed_upto, window.start_ns)
        self.stats.windows_closed += len(closed)
        return closed


def scale_sampled(value: np.ndarray, interval: np.ndarray, frac: np.ndarray) -> np.ndarray:
    """Deltas from a probe attached `frac` of their interval, scaled to the whole interval.

    Gauges (latency percentiles, live bytes) describe what was seen and stay
    as they are. A delta from a family attached for none of its interval
    carries no information; it is zeroed (the tracer sends none of those).
    """
    frac = np.asarray(frac, dtype=np.float64)
    scale = (interval > 0) & (frac < 1.0)
    if not scale.any():
        return value
    out = np.array(value, dtype=np.float64)
    f = frac[scale]
    out[scale] = np.where(f > 0, out[scale] / np.where(f > 0, f, 1.0), 0.0)
    return out


def _groups(t_codes: np.ndarray, j_codes: np.ndarray, rank: np.ndarray, win: np.ndarray):
    """Yield ((tenant code, job code, rank, window index), row selector) per distinct group."""
    if len(win) == 0:
        return
    if t_codes.min() == t_codes.max() and j_codes.min() == j_codes.max() and rank.min() == rank.max() \
            and win.min() == win.max():  # the common case: a batch is one key and one window
        yield (int(t_codes[0]), int(j_codes[0]), int(rank[0]), int(win[0])), slice(None)
        return
    ranks, r_inv = np.unique(rank, return_inverse=True)
    w0 = win.min()
    n_j, n_r, n_w = int(j_codes.max()) + 1, len(ranks), int(win.max() - w0) + 1
    group = ((t_codes.astype(np.int64) * n_j + j_codes) * n_r + r_inv) * n_w + (win - w0)
    order = np.argsort(group, kind="stable")
    sorted_group = group[order]
    bounds = np.flatnonzero(np.diff(sorted_group)) + 1
    for rows in np.split(order, bounds):
        i = rows[0]
        yield (int(t_codes[i]), int(j_codes[i]), int(rank[i]), int(win[i])), rows
