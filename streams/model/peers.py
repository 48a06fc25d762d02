"""Peer comparison: the ranks of one job should look alike within a window.

For each rank i and feature j, over the ranks that observed j in this window:
    z_ij = (x_ij - median_j) / scale_j
    scale_j = max(1.4826 * MAD_j,            this window's robust spread
                  typical_j,                  how far apart the ranks usually are
                  rel_floor * |median_j|,     a relative floor
                  step_j,                     the feature's resolution in one window
                  abs_floor)
The floors are what keep identical healthy ranks from producing huge z out of
tiny noise. One window's MAD can be near zero by chance: with 3 ranks it is the
smaller of two deviations, and a tail latency read from a quarter-octave
histogram often lands two ranks in one bucket. ``typical_j`` is an exponential
average over windows of sqrt(pi/2) * the mean absolute deviation from the
median, taken over the ranks that did not stand out (|z| < ``learn_below``),
so it learns the healthy spread from every rank, and neither one odd rank nor
a long fault drags it up (measured on the evaluation runs: with the typical MAD
instead, noisy p99 latencies of healthy ranks reached |z| 6-10 in about one
window in ten). A feature whose ranks agree to the last digit still gets
``rel_floor`` of its size.

``step_j`` is the smallest difference one window can measure (resolution_step):
a count of events moves in steps of one event per window, CPU time read from
/proc in steps of one clock tick. Ranks that usually agree exactly teach
``typical_j`` a spread near zero, and one step then read as a huge z: on the
GPU stand-in, whose ranks use ~5% of a core, one tick of proc_cpu_cores
(0.05 vs 0.06 cores in a 1 s window) against the 2% floor gave |z| ~ 10.
Features observed by fewer than ``min_ranks`` ranks get z = 0 (no peers).

A rank may differ from its peers by design (a larger batch, another pipeline
stage, another data shard): the peer detector then judges each rank against
its own usual place among its peers (RankOffsets), so that only a change in a
rank's offset is flagged, never the offset it has had from the start.
"""
from __future__ import annotations

import numpy as np

from fleetscope.streams.model.top_features import TopFeatures

MAD_TO_SIGMA = 1.4826
MEAN_AD_TO_SIGMA = 1.2533  # sqrt(pi/2), for a normal
HISTOGRAM_STEP = 2 ** 0.25 - 1   # relative width of the tracers' quarter-octave latency buckets
QUANTIZED_SUFFIXES = ("_lat_p50_ns", "_lat_p99_ns")
CPU_TICK_S = 0.01   # /proc/<pid>/stat counts CPU time in USER_HZ ticks: 100 per second on Linux
COUNT_SUFFIX = "_per_s"


def resolution_step(name: str, window_s: float) -> float:
    """The smallest difference between ranks that one window of ``window_s`` seconds can measure
    in this feature: one clock tick of CPU time, one event of a count; 0 where it is finer than any
    floor (bytes, latencies, fractions) or the window length is unknown (window_s <= 0)."""
    if window_s <= 0:
        return 0.0
    if name == "proc_cpu_cores":
        return CPU_TICK_S / window_s
    if name.endswith(COUNT_SUFFIX) and "bytes" not in name:
        return 1.0 / window_s
    return 0.0


def relative_floor(name: str, base: float) -> float:
    """The smallest relative difference between ranks that a feature can resolve."""
    return max(base, HISTOGRAM_STEP) if name.endswith(QUANTIZED_SUFFIXES) else base


def _masked_median(X: np.ndarray, observed: np.ndarray, all_observed: bool = False) -> np.ndarray:
    """Column medians over observed cells (every column has at least one); sort-based, no NaN paths.

    all_observed: every cell is observed (the usual window), so a partial sort
    around the middle suffices."""
    n = X.shape[0]
    if all_observed:
        lo, hi = (n - 1) // 2, n // 2
        P = np.partition(X, (lo, hi) if lo != hi else lo, axis=0)
        return 0.5 * (P[lo] + P[hi])
    S = np.sort(np.where(observed, X, np.inf), axis=0)
    cnt = observed.sum(axis=0)
    cols = np.arange(X.shape[1])
    return 0.5 * (S[(cnt - 1) // 2, cols] + S[cnt // 2, cols])


class PeerComparison:
    def __init__(self, min_ranks: int = 3, rel_floor: float = 0.02, abs_floor: float = 1e-9,
                 typical_rate: float = 0.05, window_s: float = 0.0):
        self.min_ranks = min_ranks
        self.rel_floor = rel_floor
        self.abs_floor = abs_floor
        self.typical_rate = typical_rate
        self.window_s = window_s       # the windows' length, for the resolution steps (0: unknown)
        self.typical = np.zeros(0)     # running healthy spread per feature (NaN until seen)
        self.floors = np.zeros(0)      # relative floor per feature (from its name)
        self.steps = np.zeros(0)       # absolute floor per feature: its resolution step, at least abs_floor
        self.last: tuple | None = None  # (columns, x - median, scale, observed) of the last window compared

    def grow(self, d: int, names: list[str] | None = None) -> None:
        extra = d - self.typical.size
        if extra > 0:
            self.typical = np.concatenate([self.typical, np.full(extra, np.nan)])
        have = self.floors.size
        if have < d:   # names known: per-feature floors; else the base floors
            new = names[have:d] if names else [""] * (d - have)
            rel = [relative_floor(n, self.rel_floor) for n in new]
            step = [max(resolution_step(n, self.window_s), self.abs_floor) for n in new]
            self.floors = np.concatenate([self.floors, np.asarray(rel, float)])
            self.steps = np.concatenate([self.steps, np.asarray(step, float)])

    def zscores(self, X: np.ndarray, observed: np.ndarray, learn: bool = True,
                learn_below: float = np.inf) -> np.ndarray:
        """(n, D) robust z; 0 where masked or with too few peers.

        learn: update the typical spread from the cells with |z| < learn_below."""
        n, D = X.shape
        self.grow(D)
        enough = observed.sum(axis=0) >= self.min_ranks
        self.last = None
        if n < self.min_ranks or not enough.any():
            return np.zeros((n, D))
        cols = np.flatnonzero(enough)
        Xc = X[:, cols]
        Oc = observed[:, cols]
        dense = bool(Oc.all())
        med = _masked_median(Xc, Oc, dense)
        diff = Xc - med
        dev = np.abs(diff)
        mad = MAD_TO_SIGMA * _masked_median(dev, Oc, dense)
        typ = self.typical[cols]
        scale = np.fmax(mad, typ)   # fmax: a NaN typical (first window) is ignored
        scale = np.maximum(scale, np.maximum(self.floors[cols] * np.abs(med), self.steps[cols]))
        zc = diff / scale
        if not dense:
            zc[~Oc] = 0.0
        self.last = (cols, diff, scale, Oc)   # the window's parts, for RankOffsets
        if learn:
            inlier = np.abs(zc) < learn_below
            if not dense:
                inlier &= Oc
            cnt = inlier.sum(axis=0)
            seen = cnt > 0
            kept = dev * inlier if dense else np.where(inlier, dev, 0.0)   # masked dev is NaN
            spread = MEAN_AD_TO_SIGMA * kept.sum(axis=0) / np.maximum(cnt, 1)
            r = self.typical_rate
            new = np.where(np.isnan(typ), spread, (1 - r) * typ + r * spread)
            self.typical[cols] = np.where(seen, new, typ)
        z = np.zeros((n, D))
        z[:, cols] = zc
        return z

    def state(self) -> dict[str, np.ndarray]:
        return {"typical": self.typical}

    def load(self, arrays, dim: int) -> None:
        """arrays: a StateArrays; one typical spread per feature."""
        self.typical = arrays.take("typical", "f8", (dim,))


OFFSET_SLACK = 1.0        # peer scales of a rank's learned offset left in its z (see RankOffsets.adjust)
SPREAD_SLACK = 1.25       # a rank's own spread within this factor of the usual rank's does not widen its scale
SPREAD_CLIP = 3.0         # a window's |d - offset| counts at most this many of the rank's spread (or peer scales)
RECENT = 5                # windows of each rank's recent differences kept per feature (their median)
MAX_OFFSET_RANKS = 512    # ranks of one job whose offsets are kept (bounded: a checkpoint carries them);
                          # further ranks are judged by plain peer z


def _median_of_filled(B: np.ndarray, filled: np.ndarray) -> np.ndarray:
    """Median over the last axis of B's first ``filled`` entries (NaN sorts last; filled >= 1)."""
    S = np.sort(B, axis=-1)
    lo = np.take_along_axis(S, ((filled - 1) // 2)[..., None], axis=-1)[..., 0]
    hi = np.take_along_axis(S, (filled // 2)[..., None], axis=-1)[..., 0]
    return 0.5 * (lo + hi)


class RankOffsets:
    """Each rank's usual offset from its peers, per feature, learned online with no healthy baseline.

    For rank r and feature j the window's difference from the peer median is d = x - median_j, and
    scale_j the window's peer scale (PeerComparison). RankOffsets keeps, per (r, j), the last
    RECENT differences d, and
        offset  while the job model warms up: the median of those recent d (a median, because many
                features are mostly 0 with bursts, page faults or bytes read, and because a job's
                start-up looks alike on every rank: the offset is the rank's place after it);
                once the model is warm it follows that median at a bounded speed, at most ``rate``
                of max(scale_j, the rank's own spread) per window.
    Until a cell has ``min_obs`` observations its z is 0 (not judged: a feature that shows up late, its place
    learned as it is, like one held from the start). Once it has them the peer detector's z becomes
        z' = (d - shrunk offset) / (scale_j * widen)
    - the shrunk offset is the part of the offset beyond OFFSET_SLACK of the larger of the peer scale
      and the rank's own spread: a rank within the peers' usual spread, or its own, is judged exactly
      as before;
    - widen >= 1 is how much noisier this rank is than the job's usual rank (the median over ranks
      of each one's spread of its recent d, or the peer scale if larger), beyond SPREAD_SLACK.
    A rank that has run twice the batch of its peers from the start has z' near 0; a rank whose
    place among its peers changes once the model is warm (a straggler from mid-run) gets z' = z,
    and keeps it: after T windows of a change its offset has moved at most T * ``rate`` of its spread
    (0.6 of it after a 30-window straggler at the default 0.02).
    Every window is remembered, flagged or not, so no offset is ever locked at a stale value;
    the bounded speed is what keeps a real straggler from being learned as the new normal.
    The price: a rank already odd when the job starts is taken as it is.
    """

    def __init__(self, rate: float = 0.02, min_obs: int = 8):
        self.rate = rate
        self.min_obs = min_obs
        self.ranks: dict[int, int] = {}       # rank -> row of the arrays below
        self.offset = np.zeros((0, 0))
        self.recent = np.zeros((0, 0, RECENT))  # ring of the last RECENT d (NaN: not yet seen)
        self.count = np.zeros((0, 0), np.int64)  # d seen per cell (the ring's next slot: count % RECENT)
        self.spread = np.zeros((0, 0))          # each cell's usual |d - offset| (see learn)

    @property
    def dim(self) -> int:
        return self.offset.shape[1]

    def grow(self, d: int) -> None:
        extra = d - self.dim
        if extra > 0:
            r = self.offset.shape[0]
            self.offset = np.hstack([self.offset, np.zeros((r, extra))])
            self.recent = np.concatenate([self.recent, np.full((r, extra, RECENT), np.nan)], axis=1)
            self.count = np.hstack([self.count, np.zeros((r, extra), np.int64)])
            self.spread = np.hstack([self.spread, np.zeros((r, extra))])

    def rows(self, ranks, add: bool) -> np.ndarray:
        """Row of each rank (-1: not kept); ``add``: new ranks get a row while there is room."""
        out = np.full(len(ranks), -1, np.int64)
        for i, r in enumerate(ranks):
            row = self.ranks.get(int(r))
            if row is None and add and len(self.ranks) < MAX_OFFSET_RANKS:
                row = self.ranks[int(r)] = len(self.ranks)
                d = self.dim
                self.offset = np.vstack([self.offset, np.zeros((1, d))])
                self.recent = np.concatenate([self.recent, np.full((1, d, RECENT), np.nan)], axis=0)
                self.count = np.vstack([self.count, np.zeros((1, d), np.int64)])
                self.spread = np.vstack([self.spread, np.zeros((1, d))])
            if row is not None:
                out[i] = row
        return out

    def adjust(self, rows: np.ndarray, cols: np.ndarray, diff: np.ndarray, scale: np.ndarray,
               observed: np.ndarray) -> np.ndarray:
        """z' of the window's compared cells (rows x cols)."""
        kept = rows >= 0
        off = np.zeros_like(diff)
        widen = np.ones_like(diff)
        judged = np.ones(diff.shape, bool)
        if kept.any():
            r = rows[kept]
            known = self.count[np.ix_(r, cols)] >= self.min_obs
            judged[kept] = known
            learned = np.where(known, self.offset[np.ix_(r, cols)], 0.0)
            # the offset counts beyond the peers' scale and the rank's own wobble alike: the wobble is also
            # how far the bounded offset may move in 1/rate windows (learn), so a straggler's first 50
            # windows do not become its place. With the peer scale alone, a rank read far more than its
            # peers during a 30 s stall, its offset moved 250 B/s a window within its 10 kB/s wobble, the
            # peers' scale then fell to 600 B/s (no rank read anything), and the rank was flagged for 27
            # windows after the stall (peer z -12)
            slack = OFFSET_SLACK * np.maximum(scale, MEAN_AD_TO_SIGMA * self.spread[np.ix_(r, cols)])
            off[kept] = np.sign(learned) * np.maximum(np.abs(learned) - slack, 0.0)
            has = known & observed[kept]
            enough = has.sum(axis=0) >= 3
            if enough.any():
                own = MEAN_AD_TO_SIGMA * self.spread[np.ix_(r, cols[enough])]
                usual = np.maximum(_masked_median(own, has[:, enough]), scale[enough])
                sub = np.ones(has.shape)
                sub[:, enough] = np.where(has[:, enough], np.maximum(own / (SPREAD_SLACK * usual), 1.0), 1.0)
                widen[kept] = sub
        z = (diff - off) / (scale * widen)
        # a cell is judged once its offset is known: a rank's place among its peers on a feature that shows
        # up after the job's start (a duty-cycled probe family the governor attaches later, at a low duty:
        # torch ops, Python calls) is learned as it is, like a place held from the start. Judged at once,
        # the dev scenarios' rank that runs twice its peers' threads by design was flagged on its op rate
        # (peer z 51) in the first windows the governor gave the torch ops
        return np.where(observed & judged, z, 0.0)

    def learn(self, rows: np.ndarray, cols: np.ndarray, diff: np.ndarray, scale: np.ndarray,
              observed: np.ndarray, warm: bool, weights: np.ndarray) -> None:
        kept = rows >= 0
        if not kept.any():
            return
        r = rows[kept]
        ix = np.ix_(r, cols)
        d = diff[kept]
        learn = observed[kept] & np.isfinite(d)
        if not learn.any():
            return
        n = self.count[ix]
        # a cell is fast (its offset is the median of its recent d) while the model warms up, and for its
        # first ``min_obs`` windows when it shows up later (a rank's feature that appears after warm-up)
        fast = np.broadcast_to(not warm, n.shape) | (n < self.min_obs)
        # the rank's own wobble: every window while fast, then only the windows the model did not flag,
        # at ``rate`` (a straggler's erratic windows must not widen its own scale)
        wobble = learn & (fast | (weights[kept] >= 1.0)[:, None])
        step = np.where(fast, np.maximum(1.0 / (n + 1), self.rate), self.rate)
        off = self.offset[ix]
        spread = self.spread[ix]
        # a window counts at most SPREAD_CLIP of the rank's usual wobble (or of the peer scale): when the job
        # model accepts a new regime (regime_windows flagged in a row) it learns every window, and a
        # straggler's peers waiting for it are flagged too, so a 30 s dataloader stall became "the new
        # normal" 20 windows in; unclipped, its reads (67 MB/s against none) made the rank's wobble 600x
        # larger, the bounded offset followed the stall at that speed, and the rank was flagged for 15
        # windows after the stall ended, reading what its peers read (peer z -20)
        cap = SPREAD_CLIP * np.maximum(spread, np.broadcast_to(scale, off.shape))
        dev = np.minimum(np.abs(np.where(learn, d, 0.0) - off), cap)
        spread = np.where(wobble, np.where(n == 0, 0.0, spread + step * (dev - spread)), spread)
        self.spread[ix] = spread
        ri, ci = np.nonzero(learn)
        self.recent[r[ri], cols[ci], n[ri, ci] % RECENT] = d[ri, ci]
        self.count[ix] = n + learn
        med = _median_of_filled(self.recent[ix], np.maximum(np.minimum(n + learn, RECENT), 1))
        bound = self.rate * np.maximum(np.broadcast_to(scale, off.shape), MEAN_AD_TO_SIGMA * spread)
        new = np.where(fast, med, off + np.clip(med - off, -bound, bound))
        self.offset[ix] = np.where(learn, new, off)

    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        ranks = np.array(sorted(self.ranks, key=self.ranks.get), np.int64)
        return {"ranks": len(self.ranks)}, {"offset_ranks": ranks, "offset": self.offset,
                                            "offset_recent": self.recent, "offset_count": self.count,
                                            "offset_spread": self.spread}

    def load(self, meta: dict, arrays, dim: int) -> None:
        n = arrays.count(meta, "ranks", MAX_OFFSET_RANKS)
        ranks = arrays.take("offset_ranks", "i8", (n,))
        if len(set(ranks.tolist())) != n:
            arrays.fail("offset_ranks: a rank appears twice")
        offset = arrays.take("offset", "f8", (n, dim))
        recent = arrays.take("offset_recent", "f8", (n, dim, RECENT))
        count = arrays.take("offset_count", "i8", (n, dim))
        spread = arrays.take("offset_spread", "f8", (n, dim))
        if not (np.isfinite(offset).all() and np.isfinite(spread).all()) or (count < 0).any() \
                or (spread < 0).any() or np.isinf(recent).any():
            arrays.fail("offset: not finite, or a negative count or spread")
        self.offset, self.recent, self.count, self.spread = offset, recent, count, spread
        self.ranks = {int(r): i for i, r in enumerate(ranks.tolist())}

    def nbytes(self) -> int:
        return self.offset.nbytes + self.recent.nbytes + self.count.nbytes + self.spread.nbytes


class PeerDetector:
    """Peer comparison as a detector: a row's score is its largest |z'| over its features, z' being
    the robust peer z measured from the rank's own usual offset (RankOffsets), and it flags at
    ``fixed_threshold``. The typical spread learns while scoring (from the cells below the threshold);
    the ranks' offsets learn in ``learn``."""
    name = "peer"
    admits_late = False
    explains = "peer_z"

    def __init__(self, comparison: PeerComparison, z_threshold: float, offsets: RankOffsets | None = None):
        self.peers = comparison
        self.fixed_threshold = z_threshold
        self.offsets = offsets          # None: plain peer z (every rank judged against the median rank)
        self._z: tuple[np.ndarray, np.ndarray] | None = None
        self._window = None             # (window, rows, cols, diff, observed, z') for learn

    @classmethod
    def from_config(cls, c) -> "PeerDetector":
        offsets = RankOffsets(c.peer_offset_rate, c.peer_offset_min_obs) if c.peer_offset_rate > 0 else None
        comparison = PeerComparison(min_ranks=c.peer_min_ranks, rel_floor=c.peer_rel_floor, window_s=c.window_s)
        return cls(comparison, c.peer_z_threshold, offsets)

    def grow(self, d: int, names: list[str]) -> None:
        self.peers.grow(d, names)
        if self.offsets is not None:
            self.offsets.grow(d)

    def score(self, w) -> np.ndarray:
        z = self.peers.zscores(w.X, w.observed, learn=w.learn, learn_below=self.fixed_threshold)
        self._window = None
        last = self.peers.last
        if self.offsets is not None and last is not None and w.ranks is not None:
            cols, diff, scale, Oc = last
            rows = self.offsets.rows(w.ranks, add=w.learn)
            za = self.offsets.adjust(rows, cols, diff, scale, Oc)
            z[:, cols] = za
            if w.learn:
                self._window = (w, rows, cols, diff, scale, Oc, za)
        self._z = (z, w.observed)
        return np.abs(z).max(axis=1, initial=0.0)

    def explain(self, names: np.ndarray, k: int):
        from_z, observed = self._z
        return TopFeatures(from_z, observed & (from_z != 0), np.abs(from_z), names, k)

    def learn(self, w, weights: np.ndarray) -> None:
        win = self._window
        self._window = None
        if win is None or win[0] is not w:
            return
        _, rows, cols, diff, scale, Oc, za = win
        self.offsets.learn(rows, cols, diff, scale, Oc, w.warm, np.asarray(weights, float))

    def rescale(self, change) -> None:
        pass                      # works on raw values: the standardization is not its business

    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        arrays = dict(self.peers.state())
        if self.offsets is None:
            return {}, arrays
        meta, a = self.offsets.state()
        arrays.update(a)
        return {"offsets": meta}, arrays

    def load(self, meta: dict, arrays, dim: int) -> None:
        self.peers.load(arrays, dim)
        saved = meta.get("offsets") if isinstance(meta, dict) else None
        if self.offsets is not None and saved is not None:
            self.offsets.load(saved, arrays, dim)
        elif saved is not None:
            arrays.fail("offsets: saved, but this model learns none (peer_offset_rate = 0)")
        # a checkpoint from before the offsets: they relearn, as after the job's start

    def nbytes(self) -> int:
        return self.peers.typical.nbytes + (self.offsets.nbytes() if self.offsets is not None else 0)
