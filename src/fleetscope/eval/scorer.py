"""Score a run's per-(rank, window) flags and diagnoses against a scenario's ground truth.

Time is seconds since the scenario clock started (t0). Windows are the grid
[k*window_s, (k+1)*window_s) for k = 0 .. ceil(duration_s / window_s) - 1, for every rank of
the job. A window the pipeline produced nothing for counts as not flagged, and
`missing_windows` says how many.

A **culprit flag** is a flagged window whose role is not `waiting`. The detector may label
a flagged window with a role (`culprit`, `waiting`, `node`, `job`); a `waiting` window is a
peer held up by the culprit and not an alert, so it is not a culprit flag. Where the store
has no role (today), every flag is a culprit flag: strict scoring counts every flag.

Labels, per (rank, window), strict (the default):
- **positive**: the rank is a culprit of a scored fault and the window overlaps a burst
  [start + onset_grace_s, end) of that fault ([start, end) for an instant fault, a crash: the window it
  happens in is the one its alert belongs to);
- **ignored**: on a culprit rank, a window that overlaps only a burst's onset grace
  [start, start + onset_grace_s) or recovery grace [end, end + recovery_grace_s); every window
  after a fault's first burst when the fault `persists` (leaked memory, a dead rank); a window
  a fault not scored (a kind made unreal here, or one with no measured effect) would make positive;
- **negative**: everything else, including every window of a healthy run and every window of a
  rank that is not a culprit, during the fault too.
`lenient=True` also ignores the windows of non-culprit ranks during a fault and its recovery
grace (the old headline: peers waiting on a straggler are not counted either way).

Metrics over the labelled windows: precision, recall, F1 and the false-positive rate
(FP / negatives); None when the denominator is 0.

Per burst (an "incident"): found in time when a culprit flag on any rank of the job lies in
[k_start, k_end_grace], the windows from the one holding the burst's start to the one holding
end + recovery_grace_s. Job level: TP incidents found, FN incidents not found, FP false
incidents: runs of consecutive grid windows holding a culprit flag on a negative window outside
every fault's bursts and recovery grace. Detection delay of a burst: k_first - k_start, where
k_first is the first window at or after k_start with a culprit flag on a culprit rank (within
the burst and its recovery grace); `delay_s` = end of that window - burst start, the earliest
an alert could exist.

KB match, per fault: in each positive window of that fault the diagnosis with the highest
confidence on a culprit rank is the window's top; the most frequent top over the fault's
windows (ties: the earliest) is compared with the fault's expected KB entry.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field

WAITING = "waiting"


@dataclass(frozen=True)
class FaultTruth:
    intervals: tuple[tuple[float, float], ...]   # bursts, (start_s, end_s)
    culprits: frozenset[int]
    kb_entry: str | None = None
    scope: str = "rank"
    persists: bool = False
    scored: bool = True
    name: str = ""
    instant: bool = False   # an event (a crash): its bursts are scored with no onset grace

    def __post_init__(self):
        if not self.intervals:
            raise ValueError("a fault needs at least one burst")
        for a, b in self.intervals:
            if not a < b:
                raise ValueError(f"burst start {a} must be before its end {b}")
        if not self.culprits:
            raise ValueError("a fault needs at least one culprit rank")


@dataclass(frozen=True)
class Truth:
    ranks: tuple[int, ...]
    duration_s: float
    window_s: float
    faults: tuple[FaultTruth, ...] = ()

    def __post_init__(self):
        if self.window_s <= 0 or self.duration_s <= 0:
            raise ValueError(f"window_s and duration_s must be > 0, got {self.window_s}, {self.duration_s}")
        for f in self.faults:
            if not set(f.culprits) <= set(self.ranks):
                raise ValueError(f"culprit ranks {sorted(f.culprits)} are not all in ranks {list(self.ranks)}")

    @property
    def healthy(self) -> bool:
        return not self.faults

    @property
    def n_windows(self) -> int:
        return math.ceil(self.duration_s / self.window_s - 1e-9)


@dataclass(frozen=True)
class WindowResult:
    """What the pipeline said about one (rank, window)."""
    rank: int
    window: int  # index into the grid; see window_index()
    flagged: bool
    score: float = float("nan")
    threshold: float = float("nan")
    role: str | None = None  # the detector's role label, where the store has one

    @property
    def culprit_flag(self) -> bool:
        return self.flagged and self.role != WAITING


@dataclass(frozen=True)
class Diagnosis:
    rank: int
    window: int
    kb_entry: str
    confidence: float = 1.0


@dataclass
class FaultScore:
    name: str
    scored: bool
    tp: int = 0
    fn: int = 0
    recall: float | None = None
    incidents: int = 0
    found: int = 0
    delays_windows: list[int] = field(default_factory=list)
    delays_s: list[float] = field(default_factory=list)
    expected_kb_entry: str | None = None
    top_kb_entry: str | None = None
    kb_match: bool | None = None
    kb_votes: dict[str, int] = field(default_factory=dict)


@dataclass
class Score:
    tp: int = 0
    fp: int = 0
    fn: int = 0
    tn: int = 0
    ignored: int = 0
    missing_windows: int = 0
    unknown_windows: int = 0  # results for a rank or window outside the grid: not scored, counted
    waiting_windows: int = 0  # flagged but labelled waiting: not culprit flags
    precision: float | None = None
    recall: float | None = None
    f1: float | None = None
    false_positive_rate: float | None = None
    job_tp: int = 0
    job_fn: int = 0
    job_fp: int = 0
    job_precision: float | None = None
    job_recall: float | None = None
    job_f1: float | None = None
    detection_delay_windows: int | None = None  # of the first scored burst; None: not detected
    detection_delay_s: float | None = None
    delays_windows: list[int] = field(default_factory=list)  # every detected scored burst
    delays_s: list[float] = field(default_factory=list)
    top_kb_entry: str | None = None
    expected_kb_entry: str | None = None
    kb_match: bool | None = None  # every scored fault with a KB entry matched (None: none expected)
    kb_faults: int = 0
    kb_hits: int = 0
    kb_votes: dict[str, int] = field(default_factory=dict)
    faults: list[FaultScore] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Score":
        d = dict(d)
        d["faults"] = [FaultScore(**f) for f in d.get("faults", [])]
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def window_index(t_s: float, window_s: float) -> int:
    """The grid window holding time t_s (seconds since the run started)."""
    return math.floor(t_s / window_s + 1e-9)


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


def _f1(p: float | None, r: float | None) -> float | None:
    if p is None or r is None:
        return None
    return 2 * p * r / (p + r) if p + r else 0.0


def _overlaps(w0: float, w1: float, a: float, b: float) -> bool:
    return w0 < b and a < w1


def fault_label(truth: Truth, f: FaultTruth, rank: int, k: int, onset_grace_s: float,
                recovery_grace_s: float) -> str | None:
    """What fault f alone says of window k on rank: positive, ignored, or None (nothing)."""
    if rank not in f.culprits:
        return None
    w0, w1 = k * truth.window_s, (k + 1) * truth.window_s
    onset = 0.0 if f.instant else onset_grace_s
    in_burst = any(_overlaps(w0, w1, a + onset, b) for a, b in f.intervals)
    if in_burst:
        return "positive" if f.scored else "ignored"
    if any(_overlaps(w0, w1, a, a + onset) or _overlaps(w0, w1, b, b + recovery_grace_s)
           for a, b in f.intervals):
        return "ignored"
    if f.persists and w0 >= f.intervals[0][0]:
        return "ignored"
    return None


def label(truth: Truth, rank: int, k: int, *, onset_grace_s: float = 0.0, recovery_grace_s: float = 0.0,
          lenient: bool = False) -> str:
    """'positive', 'negative' or 'ignored' for window k of rank (see the module docstring)."""
    seen = {fault_label(truth, f, rank, k, onset_grace_s, recovery_grace_s) for f in truth.faults}
    if "positive" in seen:
        return "positive"
    if "ignored" in seen:
        return "ignored"
    if lenient:
        w0, w1 = k * truth.window_s, (k + 1) * truth.window_s
        if any(_overlaps(w0, w1, a, b + recovery_grace_s) for f in truth.faults for a, b in f.intervals):
            return "ignored"
    return "negative"


def _in_any_fault_period(truth: Truth, k: int, recovery_grace_s: float) -> bool:
    w0, w1 = k * truth.window_s, (k + 1) * truth.window_s
    return any(_overlaps(w0, w1, a, b + recovery_grace_s) for f in truth.faults for a, b in f.intervals)


def score_run(truth: Truth, results: list[WindowResult], diagnoses: list[Diagnosis] = (), *,
              onset_grace_s: float = 0.0, recovery_grace_s: float = 0.0, lenient: bool = False) -> Score:
    s = Score()
    grid = {(r, k) for r in truth.ranks for k in range(truth.n_windows)}
    flagged: dict[tuple[int, int], bool] = {}
    for res in results:
        key = (res.rank, res.window)
        if key not in grid:
            s.unknown_windows += 1
            continue
        s.waiting_windows += res.flagged and not res.culprit_flag
        flagged[key] = flagged.get(key, False) or res.culprit_flag
    s.missing_windows = len(grid) - len({k for k in flagged})
    labels = {}
    for rank, k in sorted(grid):
        lab = labels[rank, k] = label(truth, rank, k, onset_grace_s=onset_grace_s,
                                      recovery_grace_s=recovery_grace_s, lenient=lenient)
        f = flagged.get((rank, k), False)
        if lab == "ignored":
            s.ignored += 1
        elif lab == "positive":
            s.tp, s.fn = s.tp + f, s.fn + (not f)
        else:
            s.fp, s.tn = s.fp + f, s.tn + (not f)
    s.precision = _ratio(s.tp, s.tp + s.fp)
    s.recall = _ratio(s.tp, s.tp + s.fn)
    s.f1 = _f1(s.precision, s.recall)
    s.false_positive_rate = _ratio(s.fp, s.fp + s.tn)
    _score_faults(s, truth, flagged, diagnoses, onset_grace_s, recovery_grace_s)
    _score_job(s, truth, flagged, labels, recovery_grace_s)
    return s


def _score_faults(s: Score, truth: Truth, flagged: dict, diagnoses, onset_grace_s: float,
                  recovery_grace_s: float) -> None:
    w = truth.window_s
    for f in truth.faults:
        fs = FaultScore(name=f.name, scored=f.scored, expected_kb_entry=f.kb_entry)
        s.faults.append(fs)
        if not f.scored:
            continue
        pos = {(r, k) for r in f.culprits for k in range(truth.n_windows)
               if fault_label(truth, f, r, k, onset_grace_s, recovery_grace_s) == "positive"}
        fs.tp = sum(1 for key in pos if flagged.get(key))
        fs.fn = len(pos) - fs.tp
        fs.recall = _ratio(fs.tp, len(pos))
        for a, b in f.intervals:
            fs.incidents += 1
            k0, k1 = window_index(a, w), min(window_index(b + recovery_grace_s, w), truth.n_windows - 1)
            if any(flagged.get((r, k)) for r in truth.ranks for k in range(k0, k1 + 1)):
                fs.found += 1
            hits = [k for k in range(k0, k1 + 1) if any(flagged.get((r, k)) for r in f.culprits)]
            if hits:
                fs.delays_windows.append(hits[0] - k0)
                fs.delays_s.append(round((hits[0] + 1) * w - a, 9))
        _match_kb(fs, f, pos, diagnoses)
        s.delays_windows += fs.delays_windows
        s.delays_s += fs.delays_s
        if f.kb_entry is not None:
            s.kb_faults += 1
            s.kb_hits += bool(fs.kb_match)
        for kb, n in fs.kb_votes.items():
            s.kb_votes[kb] = s.kb_votes.get(kb, 0) + n
    first = next((fs for fs in s.faults if fs.scored), None)
    if first is not None:
        s.expected_kb_entry, s.top_kb_entry = first.expected_kb_entry, first.top_kb_entry
        if first.delays_windows and first.found:
            s.detection_delay_windows, s.detection_delay_s = first.delays_windows[0], first.delays_s[0]
    if s.kb_faults:
        s.kb_match = s.kb_hits == s.kb_faults


def _score_job(s: Score, truth: Truth, flagged: dict, labels: dict, recovery_grace_s: float) -> None:
    s.job_tp = sum(fs.found for fs in s.faults if fs.scored)
    s.job_fn = sum(fs.incidents - fs.found for fs in s.faults if fs.scored)
    false_windows = sorted({k for (r, k), f in flagged.items()
                            if f and labels.get((r, k)) == "negative"
                            and not _in_any_fault_period(truth, k, recovery_grace_s)})
    s.job_fp = sum(1 for i, k in enumerate(false_windows) if i == 0 or false_windows[i - 1] != k - 1)
    s.job_precision = _ratio(s.job_tp, s.job_tp + s.job_fp)
    s.job_recall = _ratio(s.job_tp, s.job_tp + s.job_fn)
    s.job_f1 = _f1(s.job_precision, s.job_recall)


def _match_kb(fs: FaultScore, f: FaultTruth, positive: set, diagnoses) -> None:
    best: dict[tuple[int, int], Diagnosis] = {}
    for d in diagnoses:
        key = (d.rank, d.window)
        if key in positive and (key not in best or d.confidence > best[key].confidence):
            best[key] = d
    by_window: dict[int, Diagnosis] = {}  # across culprit ranks, the most confident per window
    for (_, k), d in sorted(best.items()):
        if k not in by_window or d.confidence > by_window[k].confidence:
            by_window[k] = d
    votes = Counter(d.kb_entry for _, d in sorted(by_window.items()))
    fs.kb_votes = dict(votes)
    if votes:
        top = max(votes.values())
        fs.top_kb_entry = next(d.kb_entry for _, d in sorted(by_window.items()) if votes[d.kb_entry] == top)
    if f.kb_entry is not None:
        fs.kb_match = fs.top_kb_entry == f.kb_entry


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in (0, 100]); None for no values."""
    if not values:
        return None
    v = sorted(values)
    return v[max(0, math.ceil(q / 100 * len(v)) - 1)]


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    v, mid = sorted(values), len(values) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def summarize(scores: dict[str, Score], healthy: set[str]) -> dict:
    """Pooled over scenarios: culprit-flag P/R/F1 on fault runs, job-level F1, delays, KB hit
    rate, and the flagged share of healthy runs' windows."""
    faulty = {n: s for n, s in scores.items() if n not in healthy}
    tp, fp, fn = (sum(getattr(s, k) for s in faulty.values()) for k in ("tp", "fp", "fn"))
    p, r = _ratio(tp, tp + fp), _ratio(tp, tp + fn)
    jtp, jfp, jfn = (sum(getattr(s, k) for s in scores.values()) for k in ("job_tp", "job_fp", "job_fn"))
    jp, jr = _ratio(jtp, jtp + jfp), _ratio(jtp, jtp + jfn)
    delays_w = [d for s in faulty.values() for d in s.delays_windows]
    delays_s = [d for s in faulty.values() for d in s.delays_s]
    h_fp = sum(scores[n].fp for n in healthy if n in scores)
    h_all = sum(scores[n].fp + scores[n].tn for n in healthy if n in scores)
    kb_faults = sum(s.kb_faults for s in faulty.values())
    return {"precision": p, "recall": r, "f1": _f1(p, r),
            "job": {"precision": jp, "recall": jr, "f1": _f1(jp, jr), "found": jtp, "missed": jfn,
                    "false_incidents": jfp},
            "median_delay_windows": _median(delays_w), "p90_delay_s": _percentile(delays_s, 90),
            "undetected": sorted(n for n, s in faulty.items() if s.job_tp == 0 and s.job_fn),
            "healthy_flagged_frac": _ratio(h_fp, h_all),
            "kb_hit_rate": _ratio(sum(s.kb_hits for s in faulty.values()), kb_faults),
            "kb_matched": sorted(n for n, s in faulty.items() if s.kb_match),
            "kb_missed": sorted(n for n, s in faulty.items() if s.kb_match is False)}
