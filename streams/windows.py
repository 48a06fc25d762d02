"""Event-time tumbling windows over metric batches, aggregated with numpy.

A window is keyed by (tenant, job, host, rank, window_start). It closes when
the newest event time seen for its (tenant, job, host, rank) passes
window_end + allowed lateness, or, for a key that stopped sending, after
`idle_close_s` of wall time. The wall clock never decides which window an
event belongs to; it only flushes windows nobody will add to.

A key is not taken as silent while the worker is behind on a partition that
fed it (its last message there was not the partition's newest, as the
consumer last saw the partition's end) and the messages read from that
partition since do not span idle_close_s of broker time after the key's last
one. A worker that stalls on a backlog (a slow flush on a loaded machine, a
rebalance) would otherwise close windows whose events are still queued, and
drop those events as late. A partition that keeps flowing a little behind its
end (the consumer prefetches) still shows a silent key within idle_close_s of
its traffic. Such a key waits BEHIND_IDLE_FACTOR times longer at most, so a
partition the consumer never returns to cannot hold its windows forever.

Adding a batch only does the bookkeeping (which windows, lateness, series
numbers) and logs its rows; the windows' aggregates are computed when they
close, for all closing windows in one vectorized pass (see `fold_rows`). The
sums come out bit-identical to folding batch by batch: each batch's rows are
summed first, in row order, then the batches' sums in arrival order.

Each window remembers which messages fed it, so a message is acknowledged
(and its offset committed) only once every window it touched is stored.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import islice
from typing import NamedTuple

import numpy as np

from fleetscope.wire import Batch
from fleetscope.streams.series import Interner, SeriesNumbers, split_code

StreamKey = tuple[str, str, str, int]  # tenant, job, host, rank
MARK_RETRY_S = 1.0  # how often a new key's stored mark is asked for again while the store does not answer


class MetricAgg(NamedTuple):
    """One series in one window: deltas summed, gauges' last value and mean.

    A tuple of numbers and a string, so the garbage collector stops tracking it (a worker holds one per
    series and window it has not stored yet)."""

    delta_sum: float
    interval_ns: int
    gauge_last: float
    gauge_sum: float
    gauge_n: int
    device: str


Devices = tuple[MetricAgg, ...]  # one metric's devices in the key's order of first sight


class Window:
    def __init__(self, key: StreamKey, start_ns: int, end_ns: int, slot: int, assembler: "WindowAssembler"):
        self.key, self.start_ns, self.end_ns = key, start_ns, end_ns
        self.slot = slot  # this window's id in the assembler's row log
        self.sources: set[str] = set()
        self.event_count = 0
        self.messages: list = []  # message refs that fed this window
        self._assembler = assembler
        # (source, metric, device) -> MetricAgg and (source, metric) -> its devices (a MetricAgg when there
        # is one), in one dict: the window's only object the garbage collector keeps tracking
        self._series: dict[tuple, Devices | MetricAgg] | None = None

    def _index(self) -> dict:
        if self._series is None:  # an open window read before it closed: aggregate what it has so far
            self._assembler.aggregate_open()
        return self._series

    def agg(self, source: str, metric: str, device: str = "all") -> MetricAgg | None:
        """The series' aggregate in this window, or None if it sent nothing here."""
        return self._index().get((source, metric, device))

    def devices(self, source: str, metric: str) -> Devices:
        """Every device of one metric that sent something in this window, in the key's order of first sight."""
        found = self._index().get((source, metric), ())
        return (found,) if type(found) is MetricAgg else found

    def summed_rate(self, source: str, metric: str, skip: tuple[str, ...] = ()) -> float | None:
        """Sum over the metric's devices of each one's deltas per second of the time they cover
        (a device that started mid-window counts at its own rate); None when none sent a delta."""
        rates = [a.delta_sum / (a.interval_ns / 1e9) for a in self.devices(source, metric)
                 if a.interval_ns > 0 and a.device not in skip]
        return sum(rates) if rates else None


BEHIND_IDLE_FACTOR = 6  # a key fed by a partition the worker is behind on closes as idle after this many idle_close_s


@dataclass
class WindowStats:
    windows_closed: int = 0
    late_events: int = 0  # arrived after their window closed: counted, dropped
    replayed_events: int = 0  # for windows already stored before a restart
    mark_lookup_failures: int = 0  # the store did not answer "newest stored window" for a new key
    evicted_keys: int = 0
    partition_end_unknown: int = 0  # messages handled without their partition's end (highwater): idle closing
                                    # cannot tell a backlog from silence for them


@dataclass
class _KeyState:
    id: int
    max_ts: int = -1
    closed_upto: int = -1  # newest window start this process closed
    stored_upto: int | None = None  # newest window start the store had at first sight; None: not known yet
    last_seen: float = 0.0
    ask_store_at: float = 0.0  # when to ask for stored_upto again, after the store did not answer
    partitions: set = field(default_factory=set)  # (topic, partition) that fed this key: whose owner it follows
    last_broker_ms: int = 0  # the broker timestamp of its newest message (0: not known)


@dataclass
class _PartitionPosition:
    behind: bool = False  # the last message handled was not the partition's newest
    newest_broker_ms: int = 0  # the newest broker timestamp handled from it (0: not known)


class RowLog:
    """The rows of open windows, in arrival order, as batches added them.

    A batch's rows come grouped: each group (one key and window, from one
    batch) is a contiguous run of rows with its window's slot. Groups are
    numbered in arrival order (`seq`), which is what fold_rows needs to sum
    as a batch-by-batch fold would.
    """

    FIELDS = ("local", "code", "value", "interval", "ts")

    def __init__(self) -> None:
        self._kept: dict[str, np.ndarray] | None = None  # consolidated rows, with "seq" and "slot"
        self._slots: list[int] = []  # per group since the last consolidation
        self._counts: list[int] = []
        self._parts: list[tuple] = []  # per batch: arrays in FIELDS order
        self._seq = 0  # number of the first group in _slots

    def __bool__(self) -> bool:
        return bool(self._parts) or self._kept is not None

    def append(self, slots: list[int], counts: list[int], *arrays: np.ndarray) -> None:
        self._slots += slots
        self._counts += counts
        self._parts.append(arrays)

    def rows(self) -> dict[str, np.ndarray]:
        """All logged rows as columns (FIELDS, seq, slot), kept as one consolidated part."""
        if self._parts:
            n = len(self._slots)
            new = {"seq": np.repeat(np.arange(self._seq, self._seq + n, dtype=np.int64), self._counts),
                   "slot": np.repeat(np.array(self._slots, dtype=np.int64), self._counts)}
            for i, name in enumerate(self.FIELDS):
                new[name] = np.concatenate([p[i] for p in self._parts])
            if self._kept is not None:
                new = {k: np.concatenate([self._kept[k], v]) for k, v in new.items()}
            self._kept, self._seq = new, self._seq + n
            self._slots, self._counts, self._parts = [], [], []
        return self._kept

    def keep(self, mask: np.ndarray) -> None:
        """Keep only these rows of rows()."""
        self._kept = {k: v[mask] for k, v in self.rows().items()} if mask.any() else None


class WindowAssembler:
    def __init__(self, window_s: float, allowed_lateness_s: float, idle_close_s: float,
                 stored_marks=None, clock=time.monotonic):
        self.window_ns = int(window_s * 1e9)
        self.lateness_ns = int(allowed_lateness_s * 1e9)
        self.idle_close_s = idle_close_s
        self.stored_marks = stored_marks  # key -> last stored window_start_ns (or None)
        self.clock = clock
        self.names = Interner()
        self.series = SeriesNumbers()
        self.keys: dict[StreamKey, _KeyState] = {}
        self.open: dict[tuple[StreamKey, int], Window] = {}
        self.stats = WindowStats()
        self.log = RowLog()
        self._slots = 0
        self._code_names: dict[int, tuple] = {}  # series code -> its keys in Window._series
        self._replayed: list[Window] = []  # open windows found already stored once their key's mark was known
        self._positions: dict[tuple, _PartitionPosition] = {}  # (topic, partition) -> where the worker is in it

    def _note_position(self, fed_by: tuple, message_ref) -> int:
        """Whether the partition holds messages after this one (the consumer's last known end of it), and how
        far its broker time has come. Returns the message's broker timestamp (0: not known)."""
        pos = self._positions.get(fed_by)
        if pos is None:
            pos = self._positions[fed_by] = _PartitionPosition()
        highwater = getattr(message_ref, "highwater", None)
        offset = getattr(message_ref, "offset", None)
        if highwater is None or offset is None:
            self.stats.partition_end_unknown += 1
            pos.behind = False  # not known: taken as caught up, as before
        else:
            pos.behind = offset + 1 < highwater
        broker_ms = int(getattr(message_ref, "timestamp_ms", 0) or 0)
        pos.newest_broker_ms = max(pos.newest_broker_ms, broker_ms)
        return broker_ms

    @property
    def partitions_behind(self) -> int:
        return sum(pos.behind for pos in self._positions.values())

    def _silent(self, state: _KeyState, now: float) -> bool:
        """The key sent nothing for idle_close_s of wall time, and, on each partition that fed it and that the
        worker is behind on, for idle_close_s of that partition's broker time (BEHIND_IDLE_FACTOR times
        idle_close_s of wall time at most)."""
        quiet = now - state.last_seen
        if quiet < self.idle_close_s:
            return False
        if quiet >= BEHIND_IDLE_FACTOR * self.idle_close_s:
            return True
        for p in state.partitions:
            pos = self._positions.get(p)
            if pos is None or not pos.behind:
                continue
            passed = state.last_broker_ms and pos.newest_broker_ms - state.last_broker_ms >= self.idle_close_s * 1000
            if not passed:  # its next messages may be among those not read yet
                return False
        return True

    def _state(self, key: StreamKey) -> _KeyState:
        state = self.keys.get(key)
        if state is None:
            state = self.keys[key] = _KeyState(self.series.new_key())
        if state.stored_upto is None:
            self._ask_stored_mark(key, state)
        return state

    def _ask_stored_mark(self, key: StreamKey, state: _KeyState) -> None:
        """Learn the key's newest stored window. A store that does not answer (an outage) leaves it
        unknown, to be asked again: the key's windows still open, and wait to close until it is known."""
        now = self.clock()
        if now < state.ask_store_at:
            return
        try:
            mark = self.stored_marks(key) if self.stored_marks else None
        except Exception:
            self.stats.mark_lookup_failures += 1
            state.ask_store_at = now + MARK_RETRY_S
            return
        state.stored_upto = -1 if mark is None else int(mark)

    def take_replayed(self) -> list[Window]:
        """Windows dropped because the store already held them (their messages are done)."""
        out, self._replayed = self._replayed, []
        return out

    def evict_idle(self, idle_s: float) -> list[StreamKey]:
        """Forget keys that sent nothing for idle_s and hold no open window. Their closed windows are
        stored (or waiting in a flush job); if a key comes back, its stored mark is read again."""
        now = self.clock()
        busy = {key for key, _ in self.open}
        gone = [k for k, st in self.keys.items() if now - st.last_seen >= idle_s and k not in busy]
        for k in gone:
            del self.keys[k]
        self.stats.evicted_keys += len(gone)
        return gone

    def revoke(self, partitions: set) -> tuple[list[Window], set[StreamKey]]:
        """Hand over the keys fed by these (topic, partition)s: their open windows are dropped, never
        emitted (the new owner re-reads their events from the committed offset and emits them whole),
        and the keys are forgotten, so if one comes back its mark is read again. Returns the dropped
        windows and the keys."""
        keys = {k for k, st in self.keys.items() if st.partitions & partitions}
        keys |= {k for (k, _), w in self.open.items()
                 if any((m.topic, m.partition) in partitions for m in w.messages)}
        dropped = [self.open.pop(ks) for ks in [ks for ks in self.open if ks[0] in keys]]
        self._aggregate(dropped, remove=True)  # drops their rows from the log
        for k in keys:
            self.keys.pop(k, None)
        for p in partitions:
            self._positions.pop(p, None)
        return dropped, keys

    def add(self, batch: Batch, message_ref) -> list[Window]:
        """Take a decoded metric batch in. Returns the windows it touched."""
        cols = batch.columns
        ts, value, interval = cols["ts_ns"], cols["value"], cols["interval_ns"]
        if not len(ts):
            return []
        tenant, job, rank = cols["tenant"], cols["job"], cols["rank"]
        if "sample_frac" in cols:
            value = scale_sampled(value, interval, cols["sample_frac"])
        metric, device = cols["metric"], cols["device"]
        names = self.names
        codes = names.metric_bits(batch.source, metric.values)[metric.codes] | names.ids_of(device.values)[device.codes]
        groups, order = _groups(tenant, job, rank, ts, self.window_ns)
        if order is not None:  # rows regrouped (stable: each group keeps its rows' order)
            codes, value, interval, ts = codes[order], value[order], interval[order], ts[order]
        touched = []
        now = self.clock()
        slots, key_ids, counts = [], [], []
        fed_by = (getattr(message_ref, "topic", None), getattr(message_ref, "partition", None))
        broker_ms = self._note_position(fed_by, message_ref)
        for (t, j, r, w, count, max_ts) in groups:
            key = (tenant.values[t], job.values[j], batch.host, r)
            state = self._state(key)
            state.last_seen = now
            state.partitions.add(fed_by)
            state.last_broker_ms = max(state.last_broker_ms, broker_ms)
            if max_ts > state.max_ts:
                state.max_ts = max_ts
            start = w * self.window_ns
            slot = -1
            if state.stored_upto is not None and start <= state.stored_upto:  # stored before a restart: a replay
                self.stats.replayed_events += count
            elif start <= state.closed_upto:
                self.stats.late_events += count
            else:
                window = self.open.get((key, start))
                if window is None:
                    window = self.open[(key, start)] = Window(key, start, start + self.window_ns, self._slots, self)
                    self._slots += 1
                elif window._series is not None:
                    window._series = None  # read while open: aggregate again with these rows
                window.sources.add(batch.source)
                window.event_count += count
                window.messages.append(message_ref)
                slot = window.slot
                touched.append(window)
            slots.append(slot)
            key_ids.append(state.id)
            counts.append(count)
        if touched:
            if len(touched) < len(groups):  # late or replayed rows are counted above and left out
                keep = np.repeat(np.array(slots) >= 0, counts)
                codes, value, interval, ts = codes[keep], value[keep], interval[keep], ts[keep]
                slots, key_ids, counts = zip(*[g for g in zip(slots, key_ids, counts) if g[0] >= 0])
            local = self.series.local(list(key_ids), list(counts), codes)
            self.log.append(list(slots), list(counts), local, codes, value, interval, ts)
        return touched

    def _aggregate(self, windows: list[Window], remove: bool) -> None:
        """Compute these open windows' aggregates from the logged rows; `remove` drops their rows."""
        if not windows:
            return
        if not self.log:
            for w in windows:
                w._series = {}
            return
        rows = self.log.rows()
        slot = rows["slot"]
        wanted = np.array([w.slot for w in windows], dtype=np.int64)
        lo = min(int(slot.min()), int(wanted.min()))
        dense = np.full(max(int(slot.max()), int(wanted.max())) - lo + 1, -1, dtype=np.int64)
        dense[wanted - lo] = np.arange(len(windows))
        row_window = dense[slot - lo]
        mine = row_window >= 0
        sel = {k: v[mine] for k, v in rows.items()}
        if remove:
            self.log.keep(~mine)
        out = fold_rows(row_window[mine], sel["local"], sel["seq"], sel["value"], sel["interval"], sel["ts"],
                        sel["code"])
        self._attach(windows, out)

    def _attach(self, windows: list[Window], out: dict[str, np.ndarray]) -> None:
        """Hand each window its series' aggregates, indexed by (source, metric) and (source, metric, device)."""
        bounds = np.searchsorted(out["window"], np.arange(len(windows) + 1)).tolist()
        code_names = self._code_names
        names = [code_names.get(c) or self._names_of(c) for c in out["code"].tolist()]
        aggs = map(MetricAgg._make, zip(out["delta_sum"].tolist(), out["interval_ns"].astype(np.int64).tolist(),
                                        out["gauge_last"].tolist(), out["gauge_sum"].tolist(),
                                        out["gauge_n"].tolist(), [n[2] for n in names]))
        entries = zip(names, aggs)
        for w, n in zip(windows, np.diff(bounds).tolist()):
            index: dict = {}
            several = None
            for (sm, smd, _), agg in islice(entries, n):
                index[smd] = agg
                found = index.get(sm)
                if found is None:
                    index[sm] = agg
                else:
                    if several is None:
                        several = {}
                    if sm in several:
                        several[sm].append(agg)
                    else:
                        several[sm] = [found, agg]
            if several:
                for sm, devs in several.items():
                    index[sm] = tuple(devs)
            w._series = index

    def _names_of(self, code: int) -> tuple[tuple[str, str], tuple[str, str, str], str]:
        src, metric, dev = (self.names.names[i] for i in split_code(code))
        names = self._code_names[code] = ((src, metric), (src, metric, dev), dev)
        return names

    def aggregate_open(self) -> None:
        """Aggregates of the open windows as they stand (they stay open and keep their rows)."""
        self._aggregate([w for w in self.open.values() if w._series is None], remove=False)

    def pop_closed(self, force: bool = False) -> list[Window]:
        """Windows whose key's watermark passed end + lateness, or idle keys' windows."""
        now = self.clock()
        closed, replayed = [], []
        for (key, start), window in list(self.open.items()):
            state = self.keys[key]
            idle = self._silent(state, now)
            if force or idle or window.end_ns <= state.max_ts - self.lateness_ns:
                if state.stored_upto is None:
                    self._ask_stored_mark(key, state)
                    if state.stored_upto is None:  # not known yet whether the store holds it: wait
                        continue
                if start <= state.stored_upto:
                    replayed.append(self.open.pop((key, start)))
                    self.stats.replayed_events += window.event_count
                    continue
                closed.append(self.open.pop((key, start)))
        self._aggregate(replayed, remove=True)  # drops their rows from the log
        self._replayed += replayed
        closed.sort(key=lambda w: (w.key, w.start_ns))
        for window in closed:
            state = self.keys[window.key]
            state.closed_upto = max(state.closed_upto, window.start_ns)
        self._aggregate(closed, remove=True)
        self.stats.windows_closed += len(closed)
        return closed


def fold_rows(window: np.ndarray, local: np.ndarray, seq: np.ndarray, value: np.ndarray, interval: np.ndarray,
              ts: np.ndarray, code: np.ndarray) -> dict[str, np.ndarray]:
    """Per (window, series) present in the rows: deltas' value and interval sums, gauges' sum, count and
    newest value. Rows are in arrival order; `seq` numbers their batches.

    Sums run as a batch-by-batch fold would: each batch's rows of a series in row order, then those
    per-batch sums in batch order, so the floats are identical. A gauge's last value is its newest
    sample's (ties: the later row), and NaN if none is newer than the initial mark (-1).
    """
    width = int(local.max()) + 1
    ws = window * width + local
    present, first = np.unique(ws, return_index=True)
    at = np.searchsorted(present, ws)
    n = len(present)
    delta = interval > 0
    gauge = ~delta

    def batch_then_arrival_sum(mask: np.ndarray, weights: np.ndarray) -> np.ndarray:
        if not mask.any():
            return np.zeros(n)
        pair = (seq[mask] - seq.min()) * n + at[mask]
        pairs, inv = np.unique(pair, return_inverse=True)
        per_batch = np.bincount(inv, weights=weights[mask])
        return np.bincount(pairs % n, weights=per_batch, minlength=n)

    out = {"window": present // width, "local": present % width, "code": code[first],
           "delta_sum": batch_then_arrival_sum(delta, value),
           "interval_ns": batch_then_arrival_sum(delta, interval),
           "gauge_sum": batch_then_arrival_sum(gauge, value),
           "gauge_n": np.bincount(at[gauge], minlength=n).astype(np.int64),
           "gauge_last": np.full(n, np.nan)}
    if gauge.any():
        g_at, g_ts, g_val = at[gauge], ts[gauge], value[gauge]
        order = np.lexsort((np.arange(len(g_at)), g_ts, g_at))  # by series, then time, then arrival
        last = order[np.flatnonzero(np.diff(g_at[order], append=n))]
        newest = g_ts[last] >= -1
        out["gauge_last"][g_at[last][newest]] = g_val[last][newest]
    return out


def scale_sampled(value: np.ndarray, interval: np.ndarray, frac: np.ndarray) -> np.ndarray:
    """Deltas from a probe attached `frac` of their interval, scaled to the whole interval.

    Gauges (latency percentiles, live bytes) describe what was seen and stay
    as they are. A delta from a family attached for none of its interval
    carries no information; it is zeroed (the tracer sends none of those).
    """
    frac = np.asarray(frac, dtype=np.float64)
    if not len(frac) or frac.min() >= 1.0:  # the common case: every probe attached all the time
        return value
    scale = (interval > 0) & (frac < 1.0)
    if not scale.any():
        return value
    out = np.array(value, dtype=np.float64)
    f = frac[scale]
    out[scale] = np.where(f > 0, out[scale] / np.where(f > 0, f, 1.0), 0.0)
    return out


def _groups(tenant, job, rank: np.ndarray, ts: np.ndarray, window_ns: int):
    """The batch's (tenant code, job code, rank, window index) groups in sorted order, each with its row
    count and newest ts, and the row order that makes each group a contiguous run (None: as they are)."""
    t_codes, j_codes = tenant.codes, job.codes
    t_one = len(tenant.values) == 1 or t_codes.min() == t_codes.max()
    j_one = len(job.values) == 1 or j_codes.min() == j_codes.max()
    lo_ts, hi_ts = int(ts.min()), int(ts.max())
    w0 = lo_ts // window_ns
    if t_one and j_one and w0 == hi_ts // window_ns:  # one key and window, or one window of ranks in runs
        t0, j0 = int(t_codes[0]), int(j_codes[0])
        change = np.flatnonzero(rank[1:] != rank[:-1])
        if not len(change):  # the common case: a batch is one key and one window
            return [(t0, j0, int(rank[0]), w0, len(ts), hi_ts)], None
        starts = [0] + (change + 1).tolist()
        ranks = rank[starts].tolist()
        if all(a < b for a, b in zip(ranks, ranks[1:])):  # each rank one run, in order (a node's ranks)
            counts = np.diff(starts + [len(ts)]).tolist()
            newest = np.maximum.reduceat(ts, starts).tolist()
            return [(t0, j0, r, w0, c, m) for r, c, m in zip(ranks, counts, newest)], None
    win = ts // window_ns
    ranks, r_inv = np.unique(rank, return_inverse=True)
    n_j, n_r, n_w = int(j_codes.max()) + 1, len(ranks), int(win.max() - w0) + 1
    group = ((t_codes.astype(np.int64) * n_j + j_codes) * n_r + r_inv) * n_w + (win - w0)
    order = np.argsort(group, kind="stable")
    sorted_group = group[order]
    starts = np.flatnonzero(np.r_[True, sorted_group[1:] != sorted_group[:-1]])
    firsts = order[starts]
    counts = np.diff(np.append(starts, len(order)))
    newest = np.maximum.reduceat(ts[order], starts)
    groups = list(zip(t_codes[firsts].tolist(), j_codes[firsts].tolist(), rank[firsts].tolist(),
                      win[firsts].tolist(), counts.tolist(), newest.tolist()))
    return groups, order
