"""Score a run's per-(rank, window) flags and diagnoses against a scenario's ground truth.

Time is seconds since the run started. Windows are the grid [k*window_s, (k+1)*window_s)
for k = 0 .. ceil(duration_s / window_s) - 1, for every rank of the job. A window the
pipeline produced nothing for counts as not flagged, and `missing_windows` says how many.

Labels, per (rank, window):
- **positive**: the rank is faulty and the window overlaps [start + onset_grace_s, end);
- **ignored**: on a faulty rank, a window that overlaps only the onset grace
  [start, start + onset_grace_s) or the recovery grace [end, end + recovery_grace_s);
  on other ranks during the fault (and its recovery grace), when the truth says
  `ignore_peers` or the caller passes `ignore_peers_during_fault` (in a synchronous job
  a fault on one rank makes its peers wait in every collective, so whether flagging
  a waiting peer is right cannot be told from the truth);
  on a faulty rank, every window after the fault when the truth says `effect_persists`
  (leaked memory stays held after the leak stops);
- **negative**: everything else, including every window of a healthy run.

Metrics: precision, recall, F1 and the false-positive rate (FP / negatives) over the
labelled windows; precision/recall/F1 are None when their denominator is 0.
Detection delay: k_first - k_start, where k_start is the window holding the fault start and
k_first the first flagged window at or after it on a faulty rank (None: never detected);
`detection_delay_s` = end of that window - fault start, the earliest an alert could exist.
KB match: in each positive window the diagnosis with the highest confidence on a faulty rank
is that window's top; the most frequent top over the fault (ties: the earliest) is compared
with the expected KB entry.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Truth:
    ranks: tuple[int, ...]
    duration_s: float
    window_s: float
    fault_start_s: float | None = None  # None: a healthy run
    fault_end_s: float | None = None
    faulty_ranks: frozenset[int] = frozenset()
    kb_entry: str | None = None
    ignore_peers: bool = False      # peers' windows during the fault are ignored, not negative
    effect_persists: bool = False   # on faulty ranks, windows after the fault are ignored, not negative

    def __post_init__(self):
        if self.window_s <= 0 or self.duration_s <= 0:
            raise ValueError(f"window_s and duration_s must be > 0, got {self.window_s}, {self.duration_s}")
        if (self.fault_start_s is None) != (self.fault_end_s is None):
            raise ValueError("give both fault_start_s and fault_end_s, or neither (healthy run)")
        if self.fault_start_s is not None and not self.fault_start_s < self.fault_end_s:
            raise ValueError(f"fault_start_s {self.fault_start_s} must be before fault_end_s {self.fault_end_s}")
        if not set(self.faulty_ranks) <= set(self.ranks):
            raise ValueError(f"faulty ranks {sorted(self.faulty_ranks)} are not all in ranks {list(self.ranks)}")

    @property
    def healthy(self) -> bool:
        return self.fault_start_s is None

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


@dataclass(frozen=True)
class Diagnosis:
    rank: int
    window: int
    kb_entry: str
    confidence: float = 1.0


@dataclass
class Score:
    tp: int = 0
    fp: int = 0
    fn: int = 0
    tn: int = 0
    ignored: int = 0
    missing_windows: int = 0
    unknown_windows: int = 0  # results for a rank or window outside the grid: not scored, counted
    precision: float | None = None
    recall: float | None = None
    f1: float | None = None
    false_positive_rate: float | None = None
    detection_delay_windows: int | None = None
    detection_delay_s: float | None = None
    top_kb_entry: str | None = None
    expected_kb_entry: str | None = None
    kb_match: bool | None = None
    kb_votes: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def window_index(t_s: float, window_s: float) -> int:
    """The grid window holding time t_s (seconds since the run started)."""
    return math.floor(t_s / window_s + 1e-9)


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


def _f1(p: float | None, r: float | None) -> float | None:
    if p is None or r is None:
        return None
    return 2 * p * r / (p + r) if p + r else 0.0


def label(truth: Truth, rank: int, k: int, *, onset_grace_s: float = 0.0, recovery_grace_s: float = 0.0,
          ignore_peers_during_fault: bool = False) -> str:
    """'positive', 'negative' or 'ignored' for window k of rank (see the module docstring)."""
    if truth.healthy:
        return "negative"
    w0, w1 = k * truth.window_s, (k + 1) * truth.window_s

    def overlaps(a: float, b: float) -> bool:
        return w0 < b and a < w1

    start, end = truth.fault_start_s, truth.fault_end_s
    if rank in truth.faulty_ranks:
        if overlaps(start + onset_grace_s, end):
            return "positive"
        if overlaps(start, start + onset_grace_s) or overlaps(end, end + recovery_grace_s):
            return "ignored"
        if truth.effect_persists and w0 >= end:
            return "ignored"
        return "negative"
    if (ignore_peers_during_fault or truth.ignore_peers) and overlaps(start, end + recovery_grace_s):
        return "ignored"
    return "negative"


def score_run(truth: Truth, results: list[WindowResult], diagnoses: list[Diagnosis] = (), *,
              onset_grace_s: float = 0.0, recovery_grace_s: float = 0.0,
              ignore_peers_during_fault: bool = False) -> Score:
    s = Score(expected_kb_entry=truth.kb_entry)
    grid = {(r, k) for r in truth.ranks for k in range(truth.n_windows)}
    flagged: dict[tuple[int, int], bool] = {}
    for res in results:
        key = (res.rank, res.window)
        if key not in grid:
            s.unknown_windows += 1
            continue
        flagged[key] = flagged.get(key, False) or res.flagged
    s.missing_windows = len(grid) - len(flagged)
    labels = {}
    for rank, k in sorted(grid):
        lab = labels[rank, k] = label(truth, rank, k, onset_grace_s=onset_grace_s,
                                      recovery_grace_s=recovery_grace_s,
                                      ignore_peers_during_fault=ignore_peers_during_fault)
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
    if not truth.healthy:
        k_start = window_index(truth.fault_start_s, truth.window_s)
        hits = [k for (r, k), f in flagged.items() if f and r in truth.faulty_ranks and k >= k_start]
        if hits:
            s.detection_delay_windows = min(hits) - k_start
            s.detection_delay_s = round((min(hits) + 1) * truth.window_s - truth.fault_start_s, 9)
        _match_kb(s, truth, labels, diagnoses)
    return s


def _match_kb(s: Score, truth: Truth, labels: dict, diagnoses) -> None:
    best: dict[tuple[int, int], Diagnosis] = {}
    for d in diagnoses:
        key = (d.rank, d.window)
        if labels.get(key) == "positive" and (key not in best or d.confidence > best[key].confidence):
            best[key] = d
    by_window: dict[int, Diagnosis] = {}  # across faulty ranks, the most confident per window
    for (_, k), d in sorted(best.items()):
        if k not in by_window or d.confidence > by_window[k].confidence:
            by_window[k] = d
    votes = Counter(d.kb_entry for _, d in sorted(by_window.items()))
    s.kb_votes = dict(votes)
    if votes:
        top = max(votes.values())
        s.top_kb_entry = next(d.kb_entry for _, d in sorted(by_window.items()) if votes[d.kb_entry] == top)
    if truth.kb_entry is not None:
        s.kb_match = s.top_kb_entry == truth.kb_entry


def summarize(scores: dict[str, Score], healthy: set[str]) -> dict:
    """Totals over scenarios: pooled F1 on fault runs, median delay, and flagged share of healthy runs."""
    faulty = {n: s for n, s in scores.items() if n not in healthy}
    tp = sum(s.tp for s in faulty.values())
    fp = sum(s.fp for s in faulty.values())
    fn = sum(s.fn for s in faulty.values())
    p, r = _ratio(tp, tp + fp), _ratio(tp, tp + fn)
    f1 = _f1(p, r)
    delays = sorted(s.detection_delay_windows for s in faulty.values() if s.detection_delay_windows is not None)
    median = None
    if delays:
        mid = len(delays) // 2
        median = delays[mid] if len(delays) % 2 else (delays[mid - 1] + delays[mid]) / 2
    h_fp = sum(scores[n].fp for n in healthy)
    h_all = sum(scores[n].fp + scores[n].tn for n in healthy)
    return {"precision": p, "recall": r, "f1": f1, "median_delay_windows": median,
            "undetected": sorted(n for n, s in faulty.items() if s.detection_delay_windows is None),
            "healthy_flagged_frac": _ratio(h_fp, h_all),
            "kb_matched": sorted(n for n, s in faulty.items() if s.kb_match),
            "kb_missed": sorted(n for n, s in faulty.items() if s.kb_match is False)}
