"""Incremental Gaussian mixture fit by stepwise (online) EM, with masked features.

Stepwise EM (Cappé & Moulines 2009; Liang & Klein 2009): the model keeps
expected sufficient statistics per component, per unit of data,
    s0_k = E[r_k],  s1_k = E[r_k x],  s2_k = E[r_k x x^T]  (diag: E[r_k x*x]),
and for each mini-batch moves them toward the batch's statistics with step
    eta_t = max((t + 2) ** -alpha, eta_min),  alpha in (0.5, 1],
then re-derives the parameters (M-step). ``eta_min`` > 0 keeps a finite
memory so the model follows slow drift. Rows carry weights: a row flagged as
anomalous can be down-weighted (the step shrinks by the batch's mean weight).

Masks: a cell that is not observed is marginalized out of the likelihood
(diagonal: dropped from the sum; full: the observed sub-block). In the E-step
the missing cells are filled by their conditional expectation under each
component (and, for the second moments, the conditional covariance), which
is the exact EM treatment of data missing at random: a missing source leaves
the statistics where the model already had them.

Covariance: "diag", or "full" shrunk toward its diagonal,
    Sigma = (1 - shrinkage) * S + shrinkage * diag(S),
(a fixed Ledoit-Wolf-style target), with a variance floor on the diagonal.

K: fixed (``k``; seeded by k-means++ on the first batch) or grown: seeded
with ``init_components`` the same way, then a row that no component explains (its per-dimension Mahalanobis
distance to the nearest component above the chi-square (1 - spawn_p)
quantile) spawns a component there; components that come close (per-dimension
Bhattacharyya distance below ``merge_bd``, computed on the diagonals for full
covariance) or whose weight drops under ``prune_weight`` are merged into their
nearest neighbour by adding their statistics (exact moment matching).
Never more than ``max_components``.

Score: the negative log-likelihood of the observed cells, -log sum_k pi_k N_k(x_o).

Per-feature contributions, for the responsible component c (largest
posterior), with d = x_o - mu_c,o:
  diag: c_j = 0.5 * (log(2 pi var_cj) + d_j^2 / var_cj), an exact
        decomposition: sum_j c_j = -log N_c(x_o);
  full: c_j = 0.5 * (log(2 pi) + log|Sigma_oo| / n_o + d_j * (Sigma_oo^-1 d)_j),
        also summing exactly to -log N_c(x_o); the quadratic form is split
        symmetrically (order-free, unlike a Cholesky chain rule) and the
        log-determinant evenly. A term can be negative when a feature moves
        along its correlation with the others (it "explains away").
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy.stats import norm

from fleetscope.streams.model.state_archive import StateArrays

LOG_2PI = float(np.log(2 * np.pi))
CHOL_BYTES = 4 << 20    # full covariance: factorizations kept per M-step (component x mask pattern)


def _logsumexp_rows(a: np.ndarray) -> np.ndarray:
    m = a.max(axis=1)
    return m + np.log(np.exp(a - m[:, None]).sum(axis=1))


@lru_cache(maxsize=8)
def _norm_isf(p: float) -> float:
    return float(norm.isf(p))


def _chi2_isf(p: float, dof: np.ndarray) -> np.ndarray:
    """Upper chi-square quantile, Wilson-Hilferty approximation (vectorized, cheap)."""
    z = _norm_isf(p)
    h = 2.0 / (9.0 * dof)
    return dof * (1.0 - h + z * np.sqrt(h)) ** 3


@lru_cache(maxsize=64)
def _chi2_limit(p: float, dof: float) -> float:
    """_chi2_isf(p, dof) / dof for one dof (same arithmetic as the vectorized form)."""
    return float(_chi2_isf(p, np.array([dof]))[0] / dof)


def _step(s: np.ndarray, S: np.ndarray, eta: float, W: float) -> np.ndarray:
    """(1 - eta) * s + eta * S / W, in one new array (s may be a read-only checkpoint array)."""
    out = (1 - eta) * s
    S = eta * S
    S /= W
    out += S
    return out


@dataclass
class Scored:
    nll: np.ndarray       # (n,)
    resp: np.ndarray      # (n, K) posteriors
    maha: np.ndarray      # (n, K) squared Mahalanobis distance on observed cells
    n_obs: np.ndarray     # (n,) observed cells per row


@dataclass
class GMMConfig:
    covariance: str = "diag"
    k: int | None = None
    max_components: int = 8
    init_components: int = 4
    alpha: float = 0.6
    eta_min: float = 0.02
    var_floor: float = 1e-2
    shrinkage: float = 0.1
    spawn_p: float = 1e-4
    spawn_weight: float = 0.05
    spawn_after: int = 10
    merge_bd: float = 0.02
    prune_weight: float = 1e-3
    seed: int = 0


class GaussianMixture:
    def __init__(self, cfg: GMMConfig, dim: int = 0):
        if cfg.covariance not in ("diag", "full"):
            raise ValueError(f"covariance must be 'diag' or 'full', not {cfg.covariance!r}")
        if not 0.5 < cfg.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0.5, 1], not {cfg.alpha}")
        self.cfg = cfg
        self.full = cfg.covariance == "full"
        self.t = 0
        self.rng = np.random.default_rng(cfg.seed)
        self.s0 = np.zeros(0)
        self.s1 = np.zeros((0, dim))
        self.s2 = np.zeros((0, dim, dim)) if self.full else np.zeros((0, dim))
        self._mstep()

    # ---------------------------------------------------------------- shape
    @property
    def dim(self) -> int:
        return self.s1.shape[1]

    @property
    def n_components(self) -> int:
        return self.s0.size

    def grow(self, d: int) -> None:
        """Add dimensions (a new feature): every component starts at mean 0, var 1."""
        extra = d - self.dim
        if extra <= 0:
            return
        K = self.n_components
        self.s1 = np.concatenate([self.s1, np.zeros((K, extra))], axis=1)
        if self.full:
            s2 = np.zeros((K, d, d))
            s2[:, :d - extra, :d - extra] = self.s2
            idx = np.arange(d - extra, d)
            s2[:, idx, idx] = self.s0[:, None]
            self.s2 = s2
        else:
            self.s2 = np.concatenate([self.s2, np.repeat(self.s0[:, None], extra, axis=1)], axis=1)
        self._mstep()

    # --------------------------------------------------------------- M-step
    def _mstep(self) -> None:
        s0 = np.maximum(self.s0, 1e-300)
        self.weights = self.s0 / max(self.s0.sum(), 1e-300)
        self.means = self.s1 / s0[:, None]
        floor = self.cfg.var_floor
        if self.full:
            cov = self.s2 / s0[:, None, None] - self.means[:, :, None] * self.means[:, None, :]
            diag = np.maximum(np.diagonal(cov, axis1=1, axis2=2), floor)
            lam = self.cfg.shrinkage
            cov = (1 - lam) * cov
            idx = np.arange(self.dim)
            cov[:, idx, idx] = diag
            self.cov = 0.5 * (cov + cov.transpose(0, 2, 1))
            self.var = diag
        else:
            self.var = np.maximum(self.s2 / s0[:, None] - self.means ** 2, floor)
        self._terms = None      # per-parameter terms of the density, rebuilt on first use
        self._chol = {}         # full: (component, observed dims) -> (L^-1, log|Sigma_oo|)
        self._chol_bytes = 0

    def _diag_terms(self) -> tuple[np.ndarray, ...]:
        """Diagonal density terms that depend only on the parameters, computed once per M-step
        (score, contributions and the next score share them until the parameters move):
        prec^T, (mu * prec)^T, (mu^2 * prec)^T, (log var + log 2pi)^T and their row sums
        (the all-observed case), log 2pi + log var, and the log weights."""
        if self._terms is None:
            prec = 1.0 / self.var
            mp = self.means * prec
            mmp = self.means * mp
            lv = LOG_2PI + np.log(self.var)
            self._terms = (prec.T, mp.T, mmp.T, lv.T,
                           mmp.sum(axis=1), lv.sum(axis=1), lv,
                           np.log(np.maximum(self.weights, 1e-300)))
        return self._terms

    # --------------------------------------------------------------- scores
    def _patterns(self, M: np.ndarray):
        """Rows grouped by mask pattern: [(observed dims, row indices)]."""
        if M.all():
            return [(np.arange(M.shape[1]), np.arange(M.shape[0]))]
        pats, inv = np.unique(M, axis=0, return_inverse=True)
        inv = inv.reshape(-1)
        return [(np.flatnonzero(p), np.flatnonzero(inv == i)) for i, p in enumerate(pats)]

    def _chol_inv(self, k: int, o: np.ndarray) -> tuple[np.ndarray, float]:
        """(L^-1, log|Sigma_oo|) for Sigma_oo = L L^T of component k.

        numpy's LAPACK, not scipy.linalg.solve_triangular: the latter was ~100x
        slower for these small systems on a loaded 2-core machine (thread wake-ups).
        Kept until the next M-step: score and contributions of a window share them.
        """
        key = (k, o.tobytes())
        hit = self._chol.get(key)
        if hit is None:
            sub = self.cov[k][np.ix_(o, o)]
            L = np.linalg.cholesky(sub + 1e-9 * np.eye(o.size))
            hit = np.linalg.inv(L), 2.0 * float(np.log(np.diagonal(L)).sum())
            self._chol_bytes += hit[0].nbytes
            if self._chol_bytes > CHOL_BYTES:      # many mask patterns: bounded, start over
                self._chol.clear()
                self._chol_bytes = hit[0].nbytes
            self._chol[key] = hit
        return hit

    def _log_dens(self, Z: np.ndarray, M: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(log N_k(x_o), squared Mahalanobis, n_obs); Z is 0 where masked."""
        n, K = Z.shape[0], self.n_components
        if not self.full:
            precT, mpT, mmpT, lvT, mmp_sum, lv_sum, _, _ = self._diag_terms()
            maha = (Z * Z) @ precT
            maha -= 2.0 * (Z @ mpT)
            if M.all():          # every cell observed: the mask sums are the row sums
                n_obs = np.full(n, float(M.shape[1]))
                maha += mmp_sum
                np.maximum(maha, 0.0, out=maha)
                logn = maha + lv_sum
            else:
                Mf = M.astype(float)
                n_obs = Mf.sum(axis=1)
                maha += Mf @ mmpT
                np.maximum(maha, 0.0, out=maha)
                logn = Mf @ lvT
                logn += maha
            logn *= -0.5
            return logn, maha, n_obs
        n_obs = M.sum(axis=1).astype(float)
        maha = np.zeros((n, K))
        logdet = np.zeros((n, K))
        for o, rows in self._patterns(M):
            if o.size == 0:
                continue
            Zo = Z[np.ix_(rows, o)]
            for k in range(K):
                Li, ld = self._chol_inv(k, o)
                sol = Li @ (Zo - self.means[k, o]).T
                maha[rows, k] = (sol * sol).sum(axis=0)
                logdet[rows, k] = ld
        return -0.5 * (maha + logdet + n_obs[:, None] * LOG_2PI), maha, n_obs

    def score(self, Z: np.ndarray, M: np.ndarray) -> Scored:
        if self.n_components == 0:
            n = Z.shape[0]
            return Scored(np.zeros(n), np.zeros((n, 0)), np.zeros((n, 0)), M.sum(axis=1).astype(float))
        logn, maha, n_obs = self._log_dens(Z, M)
        logw = self._diag_terms()[-1] if not self.full else np.log(np.maximum(self.weights, 1e-300))
        joint = logn
        joint += logw
        if joint.shape[1] == 1:     # one component: log-sum-exp is the term itself, posterior 1
            return Scored(-joint[:, 0], np.ones_like(joint), maha, n_obs)
        lse = _logsumexp_rows(joint)
        joint -= lse[:, None]
        np.exp(joint, out=joint)
        return Scored(-lse, joint, maha, n_obs)

    def contributions(self, Z: np.ndarray, M: np.ndarray, sc: Scored) -> np.ndarray:
        """(n, D) per-feature terms of -log N_c(x_o) for the responsible component c."""
        n, D = Z.shape
        if self.n_components == 0:
            return np.zeros((n, D))
        if not self.full:
            lv = self._diag_terms()[6]
            if self.n_components == 1:
                mu, var, lv = self.means[0], self.var[0], lv[0]
            else:
                comp = sc.resp.argmax(axis=1)
                mu, var, lv = self.means[comp], self.var[comp], lv[comp]
            out = Z - mu
            out *= out
            out /= var
            np.add(lv, out, out=out)
            out *= 0.5
            if not M.all():
                out[~M] = 0.0
            return out
        comp = sc.resp.argmax(axis=1)
        out = np.zeros((n, D))
        for o, rows in self._patterns(M):
            if o.size == 0:
                continue
            for k in np.unique(comp[rows]):
                r = rows[comp[rows] == k]
                Li, logdet = self._chol_inv(k, o)
                d = Z[np.ix_(r, o)] - self.means[k, o]
                pd = (Li.T @ (Li @ d.T)).T
                out[np.ix_(r, o)] = 0.5 * (LOG_2PI + logdet / o.size + d * pd)
        return out

    # --------------------------------------------------------------- E-step
    def _batch_stats(self, Z: np.ndarray, M: np.ndarray, Rw: np.ndarray):
        """Weighted sums of s0, s1, s2 with missing cells imputed per component."""
        S0 = Rw.sum(axis=0)
        if not self.full:
            RwT = Rw.T
            S1 = RwT @ Z
            S2 = RwT @ (Z * Z)
            if not M.all():      # a missing cell adds its component's mean and mean^2 + var
                RU = RwT @ (~M).astype(float)
                S1 += self.means * RU
                S2 += (self.means ** 2 + self.var) * RU
            return S0, S1, S2
        K, D = self.n_components, self.dim
        S1 = np.zeros((K, D))
        S2 = np.zeros((K, D, D))
        for o, rows in self._patterns(M):
            m = np.setdiff1d(np.arange(D), o)
            for k in range(K):
                rw = Rw[rows, k]
                if not rw.any():
                    continue
                Xh = np.empty((rows.size, D))
                Xh[:, o] = Z[np.ix_(rows, o)]
                if m.size:
                    cov = self.cov[k]
                    if o.size:
                        A = np.linalg.solve(cov[np.ix_(o, o)], cov[np.ix_(o, m)]).T  # (m, o)
                        Xh[:, m] = self.means[k, m] + (Xh[:, o] - self.means[k, o]) @ A.T
                        C = cov[np.ix_(m, m)] - A @ cov[np.ix_(o, m)]
                    else:
                        Xh[:, m] = self.means[k, m]
                        C = cov[np.ix_(m, m)]
                    S2[k][np.ix_(m, m)] += rw.sum() * C
                S1[k] += rw @ Xh
                S2[k] += (Xh * rw[:, None]).T @ Xh
        return S0, S1, S2

    # ------------------------------------------------------------ learning
    def _seed(self, Z: np.ndarray, M: np.ndarray) -> None:
        """First batch: k (or, when grown, init_components) k-means++ seeds."""
        D = self.dim
        k = self.cfg.k or min(self.cfg.init_components, self.cfg.max_components)
        n = Z.shape[0]
        idx = [int(self.rng.integers(n))]
        d2 = ((Z - Z[idx[0]]) ** 2).sum(axis=1)
        while len(idx) < min(k, n):
            p = d2 / d2.sum() if d2.sum() > 0 else np.full(n, 1.0 / n)
            idx.append(int(self.rng.choice(n, p=p)))
            d2 = np.minimum(d2, ((Z - Z[idx[-1]]) ** 2).sum(axis=1))
        seeds = Z[idx]
        if len(idx) < k:
            extra = seeds[self.rng.integers(len(idx), size=k - len(idx))]
            seeds = np.vstack([seeds, extra + 0.1 * self.rng.standard_normal(extra.shape)])
        w = np.full(k, 1.0 / k)
        self.s0 = w
        self.s1 = w[:, None] * seeds
        if self.full:
            self.s2 = w[:, None, None] * (np.eye(D)[None] + seeds[:, :, None] * seeds[:, None, :])
        else:
            self.s2 = w[:, None] * (1.0 + seeds ** 2)
        self._mstep()

    def partial_fit(self, Z: np.ndarray, M: np.ndarray, w: np.ndarray | None = None,
                    scored: Scored | None = None, compare: np.ndarray | None = None) -> None:
        """One stepwise-EM step on a mini-batch (rows weighted by ``w`` in [0, 1]).

        scored: the batch's score, whose responsibilities weight the statistics (it may
        cover fewer dimensions than M: the learned cells are M's). compare: the
        dimensions whose distances decide merges (None: all); fresh dimensions,
        identical in every component, would otherwise dilute the per-dimension
        distance and merge components that differ on the established ones."""
        n = Z.shape[0]
        if n == 0:
            return
        w = np.ones(n) if w is None else np.asarray(w, float)
        if w.sum() <= 0 or not M.any():
            return
        if self.n_components == 0:
            self._seed(Z, M)
            scored = None
        sc = scored if scored is not None else self.score(Z, M)
        W = w.sum()
        eta = max((self.t + 2.0) ** -self.cfg.alpha, self.cfg.eta_min) * (W / n)
        S0, S1, S2 = self._batch_stats(Z, M, sc.resp * w[:, None])
        self.s0, self.s1, self.s2 = (_step(s, S, eta, W) for s, S in ((self.s0, S0), (self.s1, S1), (self.s2, S2)))
        self.t += 1
        self._mstep()
        if self.cfg.k is None:
            if self.t > self.cfg.spawn_after:
                self._maybe_spawn(Z, M, w, sc)
            self._merge(compare)

    def fit_batch(self, Z: np.ndarray, M: np.ndarray, iters: int = 100, tol: float = 1e-7) -> float:
        """Plain batch EM on all rows (eta = 1 each iteration); returns the mean log-likelihood."""
        if self.n_components == 0:
            self._seed(Z, M)
        prev = -np.inf
        for _ in range(iters):
            sc = self.score(Z, M)
            ll = float(-sc.nll.mean())
            if ll - prev < tol:
                break
            prev = ll
            S0, S1, S2 = self._batch_stats(Z, M, sc.resp)
            n = Z.shape[0]
            self.s0, self.s1, self.s2 = S0 / n, S1 / n, S2 / n
            self._mstep()
        return float(-self.score(Z, M).nll.mean())

    def _maybe_spawn(self, Z: np.ndarray, M: np.ndarray, w: np.ndarray, sc: Scored) -> None:
        if sc.maha.shape[1] == 0:
            return
        n_obs = sc.n_obs
        ok = (w >= 1.0) & (n_obs > 0)
        if not ok.any():
            return
        if n_obs.min() == n_obs.max():      # every row has as many cells (the usual window)
            dof = max(float(n_obs[0]), 1.0)
            per_dim = sc.maha.min(axis=1) / dof
            limit = _chi2_limit(self.cfg.spawn_p, dof)
        else:
            dof = np.maximum(n_obs, 1)
            per_dim = sc.maha.min(axis=1) / dof
            limit = _chi2_isf(self.cfg.spawn_p, dof) / dof
        excess = np.where(ok, per_dim / limit, 0.0)
        i = int(excess.argmax())
        if excess[i] <= 1.0:
            return
        best = int(sc.resp[i].argmax())
        mean = np.where(M[i], Z[i], self.means[best])
        w0 = self.cfg.spawn_weight
        self.s0, self.s1, self.s2 = (1 - w0) * self.s0, (1 - w0) * self.s1, (1 - w0) * self.s2
        if self.full:
            cov = np.tensordot(self.weights, self.cov, axes=1)
            s2_new = w0 * (cov + np.outer(mean, mean))
        else:
            s2_new = w0 * (self.weights @ self.var + mean ** 2)
        self.s0 = np.append(self.s0, w0)
        self.s1 = np.vstack([self.s1, w0 * mean])
        self.s2 = np.concatenate([self.s2, s2_new[None]], axis=0)
        self._mstep()

    def _bhattacharyya(self, compare: np.ndarray | None = None) -> np.ndarray:
        """(K, K) per-dimension Bhattacharyya distance between components (diagonals),
        averaged over the ``compare`` dimensions (all when None or empty)."""
        var, means = self.var, self.means
        if compare is not None and compare.any() and not compare.all():
            var, means = var[:, compare], means[:, compare]
        va, vb = var[:, None, :], var[None, :, :]
        dm = means[:, None, :] - means[None, :, :]
        vs = va + vb
        bd = (dm ** 2 / (4.0 * vs) + 0.5 * np.log(vs / (2.0 * np.sqrt(va * vb)))).mean(axis=2)
        np.fill_diagonal(bd, np.inf)
        return bd

    def _merge(self, compare: np.ndarray | None = None) -> None:
        while self.n_components > 1:
            bd = self._bhattacharyya(compare)
            light = np.flatnonzero(self.weights < self.cfg.prune_weight)
            if self.n_components > self.cfg.max_components:
                a, b = np.unravel_index(np.argmin(bd), bd.shape)
            elif light.size:
                a = int(light[0])
                b = int(np.argmin(bd[a]))
            elif bd.min() < self.cfg.merge_bd:
                a, b = np.unravel_index(np.argmin(bd), bd.shape)
            else:
                return
            a, b = int(min(a, b)), int(max(a, b))
            self.s0[a] += self.s0[b]
            self.s1[a] += self.s1[b]
            self.s2[a] += self.s2[b]
            keep = np.arange(self.n_components) != b
            self.s0, self.s1, self.s2 = self.s0[keep], self.s1[keep], self.s2[keep]
            self._mstep()

    def affine(self, a: np.ndarray, b: np.ndarray, moved: np.ndarray, fresh: np.ndarray) -> None:
        """Carry the statistics into new coordinates x' = a x + b on ``moved`` dims;
        ``fresh`` dims (just became usable) restart at mean 0, var 1."""
        if self.n_components == 0 or not (moved.any() or fresh.any()):
            return
        a = np.where(moved, a, 1.0)
        b = np.where(moved, b, 0.0)
        s0, s1 = self.s0, self.s1
        if self.full:
            as1 = a * s1
            s2 = (a[:, None] * a[None, :]) * self.s2
            s2 += as1[:, :, None] * b[None, None, :] + b[None, :, None] * as1[:, None, :]
            s2 += s0[:, None, None] * np.outer(b, b)[None]
            f = np.flatnonzero(fresh)
            s2[:, f, :] = 0.0
            s2[:, :, f] = 0.0
            s2[:, f, f] = s0[:, None]
        else:
            s2 = a ** 2 * self.s2 + 2 * a * b * s1 + b ** 2 * s0[:, None]
            s2 = np.where(fresh, s0[:, None], s2)
        s1 = np.where(fresh, 0.0, a * s1 + b * s0[:, None])
        self.s1, self.s2 = s1, s2
        self._mstep()

    # ----------------------------------------------------------- checkpoint
    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        meta = {"t": self.t, "rng": self.rng.bit_generator.state}
        return meta, {"s0": self.s0, "s1": self.s1, "s2": self.s2}

    def load(self, meta: dict, arrays, dim: int | None = None) -> None:
        """arrays: a StateArrays (or a dict of arrays); shapes are checked against ``dim`` features
        (default: this mixture's) and the component limit."""
        if isinstance(arrays, dict):
            arrays = StateArrays(arrays)
        dim = self.dim if dim is None else dim
        self.t = arrays.count(meta, "t", 1 << 62)
        most = max(self.cfg.k or 0, self.cfg.max_components)
        s0 = arrays.take("s0", "f8", (None,))
        if s0.size > most:
            arrays.fail(f"s0: {s0.size} components, over the limit of {most}")
        K = s0.size
        s1 = arrays.take("s1", "f8", (K, dim))
        s2 = arrays.take("s2", "f8", (K, dim, dim) if self.full else (K, dim))
        if not all(np.isfinite(a).all() for a in (s0, s1, s2)):
            arrays.fail("s0/s1/s2: statistics must be finite")
        try:
            self.rng.bit_generator.state = meta["rng"]
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            arrays.fail(f"rng: not a random generator state ({exc!r})")
        self.s0, self.s1, self.s2 = s0, s1, s2
        self._mstep()

    def nbytes(self) -> int:
        """The model's arrays. Not counted: the per-M-step caches rebuilt on use (diag: four
        K x D term arrays; full: factorizations, at most CHOL_BYTES)."""
        arrays = [self.s0, self.s1, self.s2, self.weights, self.means, self.var]
        if self.full:
            arrays.append(self.cov)
        return sum(x.nbytes for x in arrays)
