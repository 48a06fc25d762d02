"""One job's anomaly model: the facade the stream worker calls once per closed window.

    model = JobModel(ModelConfig())
    scores = model.process_window(window_start_ns, [(rank, {name: value}), ...])

Per window (all ranks of the job together, one mini-batch):
 1. rows -> matrix with a mask (absent names are masked, never zero);
 2. standardize the usable cells (features with enough history);
 3. score every rank: mixture NLL with per-feature contributions, robust
    peer z-scores, and the comparison detectors that are configured;
 4. after warm-up, each score detector flags against its own DSPOT threshold,
    peers flag on |z| >= peer_z_threshold, and the ensemble rule decides;
 5. learn: flagged rows get ``anomaly_weight`` (0: not learned). When most of
    the job's ranks have been flagged ``regime_windows`` windows in a row the
    job itself has changed (a new phase), and those windows are learned in full
    (counted in ``stats['regime_windows_learned']``) so that alarms end.
A window that is not newer than the last one learned (a replay after a
restart) is scored but not learned, and counted.
"""
from __future__ import annotations

import numpy as np

from fleetscope.streams.model import checkpoint
from fleetscope.streams.model.config import ModelConfig, WindowScore
from fleetscope.streams.model.detectors import Mahalanobis
from fleetscope.streams.model.ensemble import Rule
from fleetscope.streams.model.feature_admission import FeatureAdmission
from fleetscope.streams.model.feature_index import FeatureIndex
from fleetscope.streams.model.gmm import GaussianMixture, GMMConfig
from fleetscope.streams.model.half_space_trees import HalfSpaceTrees
from fleetscope.streams.model.peers import PeerComparison
from fleetscope.streams.model.scaling import MaskedStandardizer
from fleetscope.streams.model.threshold import DSpot
from fleetscope.streams.model.top_features import TopFeatures

SCORED_DETECTORS = ("gmm", "mahalanobis", "hst")
OUTPUT_ORDER = ("gmm", "peer", "hst", "mahalanobis")   # WindowScore.detectors order


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
        self.gmm = GaussianMixture(GMMConfig(
            covariance=c.covariance, k=c.k, max_components=c.max_components, alpha=c.alpha,
            eta_min=c.eta_min, var_floor=c.var_floor, shrinkage=c.shrinkage, spawn_p=c.spawn_p,
            merge_bd=c.merge_bd, seed=c.seed))
        self.peers = PeerComparison(min_ranks=c.peer_min_ranks, rel_floor=c.peer_rel_floor)
        self.mahal = (Mahalanobis(c.alpha, c.eta_min, c.var_floor, c.shrinkage)
                      if "mahalanobis" in c.detectors else None)
        self.hst = (HalfSpaceTrees(c.hst_trees, c.hst_height, c.hst_window, c.seed)
                    if "hst" in c.detectors else None)
        self.thresholds = {name: self._new_threshold() for name in SCORED_DETECTORS if name in c.detectors}
        self.admission = FeatureAdmission(self._new_threshold, c.rejoin_windows,
                                          [d for d in ("gmm", "mahalanobis") if d in self.thresholds])
        self.windows = 0
        self.last_window_ns = -1
        self.flagged_run = 0
        self.stats = {"rows": 0, "replayed_windows": 0, "regime_windows_learned": 0,
                      "unscorable_rows": 0, "features_admitted": 0}

    # ------------------------------------------------------------ helpers
    @property
    def warm(self) -> bool:
        return self.thresholds["gmm"].calibrated

    def _new_threshold(self) -> DSpot:
        c = self.config
        return DSpot(risk=c.risk, level=c.tail_level, depth=c.dspot_depth, tail_uncertainty=c.tail_uncertainty)

    def _grow(self, d: int) -> None:
        self.scaler.grow(d)
        self.admission.grow(d)
        self.gmm.grow(d)
        self.peers.grow(d, self.index.names)
        if self.mahal:
            self.mahal.grow(d)
        if self.hst:
            self.hst.grow(d)

    # -------------------------------------------------------------- public
    def process_window(self, window_start_ns: int, rows: list[tuple[int, dict[str, float]]]) -> list[WindowScore]:
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
        Zs = zeroed_outside(Z, S, usable)
        sc = self.gmm.score(Zs, S)
        contrib = self.gmm.contributions(Zs, S, sc)
        pz = self.peers.zscores(X, M, learn=not replay, learn_below=c.peer_z_threshold)
        scorable = sc.n_obs > 0
        self.stats["unscorable_rows"] += int((~scorable).sum())
        scores = {"gmm": sc.nll}
        if self.mahal:
            scores["mahalanobis"] = self.mahal.score(Zs, S)
        shadow_scores = None
        if adm.active:                         # late features pending: their shadow thresholds' scores
            E = adm.extended(usable)
            Ze = zeroed_outside(Z, E, usable)
            shadow_scores = {"gmm": self.gmm.score(Ze, E).nll}
            if self.mahal:
                shadow_scores["mahalanobis"] = self.mahal.score(Ze, E)
        if self.hst:
            scores["hst"] = self.hst.score(X, usable)

        n = len(rows)
        warm = self.warm
        fired: dict[str, np.ndarray] = {}
        gmm_threshold = None
        if warm:
            gmm_threshold = self.thresholds["gmm"].threshold()
            for name, s in scores.items():
                f = np.zeros(n, bool)
                f[scorable] = self.thresholds[name].step(s[scorable], learn=not replay)
                fired[name] = f
            fired["peer"] = np.abs(pz).max(axis=1, initial=0.0) >= c.peer_z_threshold
            votes = np.zeros(n, np.int64)      # Rule.decide, for all rows at once
            for d in self.rule.names:
                if d in fired:
                    votes += fired[d]
            anomaly = votes >= self.rule.k
        else:
            anomaly = np.zeros(n, bool)
            if not replay and self.windows > c.warmup_windows // 2:
                for name, s in scores.items():
                    self.thresholds[name].warm(s[scorable])
            if not replay and self.windows >= c.warmup_windows:
                for t in self.thresholds.values():
                    if t.init.size >= 10:
                        t.calibrate()

        if not replay:
            self._learn(X, M, Z, usable, sc, anomaly)
            if shadow_scores is not None:
                normal = scorable & ~anomaly
                adm.observe({name: s[normal] for name, s in shadow_scores.items()})
                self.stats["features_admitted"] += adm.admit(self.thresholds, warm)

        names = self.index.name_array()
        top_c = TopFeatures(contrib, S, contrib, names, c.top_k)
        top_z = TopFeatures(pz, M & (pz != 0), np.abs(pz), names, c.top_k)
        detectors: list[list[str]] = [[] for _ in range(n)]
        for d in OUTPUT_ORDER:
            if d in fired:
                for i in np.flatnonzero(fired[d]).tolist():
                    detectors[i].append(d)
        # positional: one object per rank per window, and keywords cost ~0.5 us each here
        return [WindowScore(r, s, gmm_threshold, a, det, top_c, top_z, warm, i)
                for i, (r, s, a, det) in enumerate(zip(ranks.tolist(), sc.nll.tolist(), anomaly.tolist(), detectors))]

    def _learn(self, X, M, Z, usable, sc, anomaly) -> None:
        c = self.config
        self.flagged_run = self.flagged_run + 1 if anomaly.mean() > 0.5 else 0
        if self.flagged_run >= c.regime_windows:
            w = np.ones(len(anomaly))
            self.stats["regime_windows_learned"] += 1
        else:
            w = np.where(anomaly, c.anomaly_weight, 1.0)
        self.gmm.partial_fit(Z, usable, w, scored=sc, compare=self.admission.scored)
        if self.mahal:
            self.mahal.learn(Z, usable, w)
        normal = w >= 1.0
        if self.hst:
            self.hst.learn(X, usable, normal)
        change = self.scaler.update(X, M & normal[:, None])
        if change is not None:
            args = (change.a, change.b, change.moved, change.fresh)
            self.gmm.affine(*args)
            if self.mahal:
                self.mahal.affine(*args)

    def memory_bytes(self) -> int:
        total = self.gmm.nbytes() + sum(a.nbytes for a in self.scaler.state().values())
        total += self.peers.typical.nbytes + sum(t.nbytes() for t in self.thresholds.values())
        total += sum(len(n) + 64 for n in self.index.names) * 2   # names list + index dict
        if self.mahal:
            total += self.mahal.g.nbytes()
        if self.hst:
            total += self.hst.nbytes()
        return total

    # ----------------------------------------------------------- checkpoint
    def to_bytes(self) -> bytes:
        return checkpoint.dump(self)

    @classmethod
    def from_bytes(cls, blob: bytes) -> "JobModel":
        """The model saved by to_bytes; raises checkpoint.CheckpointError (one line) on any fault."""
        return checkpoint.load(blob, cls)
