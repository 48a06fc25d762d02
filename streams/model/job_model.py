"""One job's anomaly model: the facade the stream worker calls once per closed window.

    model = JobModel(ModelConfig())
    scores = model.process_window(window_start_ns, [(rank, {name: value}), ...])

Per window (all ranks of the job together, one mini-batch):
 1. rows -> matrix with a mask (absent names are masked, never zero);
 2. standardize the usable cells (features with enough history);
 3. every configured detector (detector.py, detector_registry.py) scores every
    rank; the primary one (the mixture's NLL) is each WindowScore's score;
 4. after warm-up, each detector flags against its own DSPOT threshold or its
    fixed one (peers: |z| >= peer_z_threshold), and the ensemble rule decides;
 5. learn: flagged rows get ``anomaly_weight`` (0: not learned), and so do rows
    the caller holds (``hold``: a rank under a detected change, model/drift.py).
    Each DSPOT threshold learns only the scores of rows that are neither
    flagged by the ensemble (any detector) nor held: a fault that one detector
    sees must not raise another's threshold (an onset's scores just under the
    threshold, learned as peaks, lifted it from 32 to 48 and absorbed the
    fault). When most of
    the job's ranks have been flagged ``regime_windows`` windows in a row the
    job itself has changed (a new phase), and those windows are learned in full
    (counted in ``stats['regime_windows_learned']``) so that alarms end.
    When most ranks were flagged for at most ``phase_windows`` windows in a row and the
    next window is not, the job went through a short phase of its own (a checkpoint's
    writes, an evaluation pass): those windows are learned then, after the fact, in full
    (``stats['phase_windows_learned']``). A phase that repeats becomes a component of the
    mixture instead of an alarm each time: on the dev scenario healthy_eval_checkpoint,
    every checkpoint flagged every rank all through the run, its score growing from 1.2e3
    to 4.3e3 as the mixture tightened around the windows between them. A fault lasts longer
    and is never learned this way; a burst still going on is kept only in memory (a restart
    forgets it, and its windows stay unlearned).
A window that is not newer than the last one learned (a replay after a
restart) is scored but not learned, and counted.
"""
from __future__ import annotations

import numpy as np

from fleetscope.streams.model import checkpoint
from fleetscope.streams.model.config import ModelConfig, WindowScore
from fleetscope.streams.model.detector import WindowCells
from fleetscope.streams.model.detector_registry import PRIMARY, build
from fleetscope.streams.model.ensemble import Rule
from fleetscope.streams.model.feature_admission import FeatureAdmission
from fleetscope.streams.model.feature_index import FeatureIndex
from fleetscope.streams.model.scaling import MaskedStandardizer
from fleetscope.streams.model.threshold import DSpot

EXPLAINED = ("contributions", "peer_z")     # the WindowScore fields a detector's explanation fills


def zeroed_outside(Z: np.ndarray, mask: np.ndarray, usable: np.ndarray) -> np.ndarray:
    """Z with 0 where ``mask`` is False: the density code reads a masked cell as 0, and Z is
    already 0 wherever the cell is not usable, so a mask that is ``usable`` needs no copy."""
    return Z if mask is usable else np.where(mask, Z, 0.0)


class JobModel:
    def __init__(self, config: ModelConfig | None = None):
        c = self.config = config or ModelConfig()
        self.rule = Rule.parse(c.rule)
        self.index = FeatureIndex(c.max_features)
        self.scaler = MaskedStandardizer(min_obs=c.scaler_min_obs, freeze_obs=c.scaler_freeze_obs)
        self.detectors = build(c)
        # detectors without a fixed threshold flag against a DSPOT threshold each
        self.thresholds = {name: self._new_threshold() for name, d in self.detectors.items()
                           if d.fixed_threshold is None}
        self.admission = FeatureAdmission(self._new_threshold, c.rejoin_windows,
                                          [name for name in self.thresholds if self.detectors[name].admits_late])
        self.windows = 0
        self.last_window_ns = -1
        self.flagged_run = 0
        self._burst: list[tuple[WindowCells, np.ndarray | None]] = []   # a short burst's windows, until it ends
        self.stats = {"rows": 0, "replayed_windows": 0, "regime_windows_learned": 0, "admission_windows_skipped": 0,
                      "unscorable_rows": 0, "features_admitted": 0, "phase_windows_learned": 0}

    # ------------------------------------------------------------ helpers
    @property
    def warm(self) -> bool:
        return self.thresholds[PRIMARY].calibrated

    def _new_threshold(self) -> DSpot:
        c = self.config
        return DSpot(risk=c.risk, level=c.tail_level, depth=c.dspot_depth, tail_uncertainty=c.tail_uncertainty,
                     warm_detrend=c.warm_detrend)

    def _grow(self, d: int) -> None:
        self.scaler.grow(d)
        self.admission.grow(d)
        for det in self.detectors.values():
            det.grow(d, self.index.names)

    # -------------------------------------------------------------- public
    def process_window(self, window_start_ns: int, rows: list[tuple[int, dict[str, float]]],
                       hold=None) -> list[WindowScore]:
        """Score, flag and learn one window; ``hold`` (per row, optional): rows not to learn from."""
        if not rows:
            return []
        c = self.config
        ranks, X, M = self.index.matrix(rows)
        self._grow(self.index.size)
        replay = window_start_ns <= self.last_window_ns
        if replay:
            self.stats["replayed_windows"] += 1
        else:
            self.windows += 1
            self.last_window_ns = window_start_ns
            self.stats["rows"] += len(rows)

        adm = self.admission
        ready = self.scaler.ready()
        if not replay and self.windows > c.warmup_windows // 2:
            adm.fix(ready)                     # thresholds warm from here: the scored set is fixed
            adm.begin(ready)
        usable = M & ready
        Z = self.scaler.transform(X, usable)
        S = adm.mask(usable)                   # the scored features' cells
        w = WindowCells(X, M, usable, Z, S, zeroed_outside(Z, S, usable), adm.scored, learn=not replay,
                        ranks=ranks, warm=self.warm)
        scores = {name: det.score(w) for name, det in self.detectors.items()}
        scorable = S.any(axis=1)               # rows with a scored cell; the others cannot be judged
        self.stats["unscorable_rows"] += int((~scorable).sum())
        shadow_scores = None
        if adm.active:                         # late features pending: their shadow thresholds' scores
            E = adm.extended(usable)
            shadow = w.with_late_features(E, zeroed_outside(Z, E, usable))
            shadow_scores = {name: self.detectors[name].score(shadow) for name in adm.detectors}

        n = len(rows)
        warm = self.warm
        fired: dict[str, np.ndarray] = {}
        primary_threshold = None
        if warm:
            primary_threshold = self.thresholds[PRIMARY].threshold()
            for name, det in self.detectors.items():
                if det.fixed_threshold is not None:
                    fired[name] = scores[name] >= det.fixed_threshold
                else:
                    f = np.zeros(n, bool)
                    f[scorable] = self.thresholds[name].step(scores[name][scorable], learn=False)
                    fired[name] = f
            votes = np.zeros(n, np.int64)      # Rule.decide, for all rows at once
            for d in self.rule.names:
                if d in fired:
                    votes += fired[d]
            anomaly = votes >= self.rule.k
            held = np.zeros(n, bool) if hold is None else np.asarray(hold, bool)
            if not replay:   # thresholds learn the normal rows only (see 5. above)
                normal = scorable & ~anomaly & ~held
                for name, t in self.thresholds.items():
                    t.step(scores[name][normal], learn=True)
        else:
            anomaly = np.zeros(n, bool)
            if not replay and self.windows > c.warmup_windows // 2:
                for name, t in self.thresholds.items():
                    t.warm(scores[name][scorable])
            if not replay and self.windows >= c.warmup_windows:
                for t in self.thresholds.values():
                    if t.init.size >= 10:
                        t.calibrate()

        if not replay:
            self._learn(w, anomaly, None if hold is None else np.asarray(hold, bool))
            if shadow_scores is not None and anomaly.any():
                self.stats["admission_windows_skipped"] += 1
            elif shadow_scores is not None:
                normal = scorable & ~anomaly
                adm.observe({name: s[normal] for name, s in shadow_scores.items()})
                self.stats["features_admitted"] += adm.admit(self.thresholds, warm)

        names = self.index.name_array()
        tops = {det.explains: det.explain(names, c.top_k) for det in self.detectors.values() if det.explains}
        top_c, top_z = (tops.get(field) for field in EXPLAINED)
        detectors: list[list[str]] = [[] for _ in range(n)]
        for d, f in fired.items():             # registry order: WindowScore.detectors' order
            for i in np.flatnonzero(f).tolist():
                detectors[i].append(d)
        # positional: one object per rank per window, and keywords cost ~0.5 us each here
        return [WindowScore(r, s, primary_threshold, a, det, top_c, top_z, warm, i)
                for i, (r, s, a, det) in enumerate(zip(ranks.tolist(), scores[PRIMARY].tolist(), anomaly.tolist(),
                                                        detectors))]

    def _learn(self, w: WindowCells, anomaly: np.ndarray, held: np.ndarray | None = None) -> None:
        c = self.config
        burst = anomaly.mean() > 0.5
        self.flagged_run = self.flagged_run + 1 if burst else 0
        if self.flagged_run >= c.regime_windows:
            weights = np.ones(len(anomaly))
            self.stats["regime_windows_learned"] += 1
        else:
            weights = np.where(anomaly, c.anomaly_weight, 1.0)
        weights = self._fit(w, weights, held)
        self._learn_phase(w, burst, held)
        change = self.scaler.update(w.X, w.observed & (weights >= 1.0)[:, None])
        if change is not None:
            for det in self.detectors.values():
                det.rescale(change)

    def _fit(self, w: WindowCells, weights: np.ndarray, held: np.ndarray | None) -> np.ndarray:
        """Every detector learns the window's rows at ``weights``, rows the caller holds at most at
        ``anomaly_weight``; returns the weights used."""
        if held is not None:
            weights = np.where(held, np.minimum(weights, self.config.anomaly_weight), weights)
        for det in self.detectors.values():
            det.learn(w, weights)
        return weights

    def _learn_phase(self, w: WindowCells, burst: bool, held: np.ndarray | None) -> None:
        """Keep a burst's windows while it lasts; once it ends within ``phase_windows``, learn them in full (rows
        the caller holds excepted). One that lasts longer is dropped: a fault, or a change the regime rule takes."""
        limit = self.config.phase_windows
        if limit <= 0:
            return
        if burst:
            if len(self._burst) <= limit:   # one over the limit marks a burst too long to be a phase
                self._burst.append((w, held))
            return
        # a feature new since (the index grew) would leave the kept windows narrower than the model: drop them
        if self._burst and len(self._burst) <= limit and all(bw.X.shape[1] == w.X.shape[1] for bw, _ in self._burst):
            for bw, bheld in self._burst:
                self._fit(bw, np.ones(bw.X.shape[0]), bheld)
            self.stats["phase_windows_learned"] += len(self._burst)
        self._burst = []

    def memory_bytes(self) -> int:
        total = sum(det.nbytes() for det in self.detectors.values())
        total += sum(a.nbytes for a in self.scaler.state().values())
        total += sum(t.nbytes() for t in self.thresholds.values())
        total += sum(len(n) + 64 for n in self.index.names) * 2   # names list + index dict
        return total

    # ----------------------------------------------------------- checkpoint
    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """What the model learned: JSON-able scalars and plain arrays named "<part>/<name>"."""
        arrays: dict[str, np.ndarray] = {}

        def put(part: str, d: dict) -> None:
            arrays.update({f"{part}/{k}": v for k, v in d.items()})

        meta = {"index": self.index.state(), "windows": self.windows, "last_window_ns": self.last_window_ns,
                "flagged_run": self.flagged_run, "stats": self.stats, "detectors": {}, "thresholds": {}}
        for name, det in self.detectors.items():
            meta["detectors"][name], a = det.state()
            put(f"det_{name}", a)
        for name, t in self.thresholds.items():
            meta["thresholds"][name], a = t.state()
            put(f"thr_{name}", a)
        meta["admission"], a = self.admission.state()
        put("admission", a)
        put("scaler", self.scaler.state())
        return meta, arrays

    def load(self, meta: dict, arrays) -> None:
        """Restore ``state()`` into this freshly built model; ``arrays`` is a StateArrays.
        Raises CheckpointError naming what does not fit."""
        try:
            self.index = FeatureIndex.from_state(meta.get("index"), self.config.max_features)
        except ValueError as exc:
            arrays.fail(str(exc))
        dim = self.index.size
        self.windows = arrays.count(meta, "windows", 1 << 62)
        self.flagged_run = arrays.count(meta, "flagged_run", 1 << 62)
        last = meta.get("last_window_ns")
        if type(last) is not int or not -1 <= last < 1 << 63:
            arrays.fail(f"last_window_ns: {last!r} is not a time in ns")
        self.last_window_ns = last
        stats = meta.get("stats")
        if not isinstance(stats, dict) or set(stats) - set(self.stats) \
                or not all(type(v) is int and v >= 0 for v in stats.values()):
            arrays.fail("stats: not an object of this model's counters")
        self.stats.update(stats)
        for key, have in (("detectors", self.detectors), ("thresholds", self.thresholds)):
            saved = arrays.mapping(meta, key)
            if set(saved) != set(have):
                arrays.fail(f"{key}: {sorted(saved)}, this model has {sorted(have)}")
        for name, det in self.detectors.items():
            det.load(meta["detectors"][name], arrays.part(f"det_{name}"), dim)
        for name, t in self.thresholds.items():
            t.load(meta["thresholds"][name], arrays.part(f"thr_{name}"))
        self.admission.load(arrays.mapping(meta, "admission"), arrays.part("admission"), dim)
        self.scaler.load(arrays.part("scaler"), dim)

    def to_bytes(self, parts=None) -> bytes:
        """The model, and ``parts`` (name -> the job's detectors outside it: checkpoint.py) beside it."""
        return checkpoint.dump(self, parts)

    @classmethod
    def from_bytes(cls, blob: bytes, parts=None) -> "JobModel":
        """The model saved by to_bytes (``parts`` restored in place where saved); raises
        checkpoint.CheckpointError (one line) on any fault."""
        return checkpoint.load(blob, cls, parts)
