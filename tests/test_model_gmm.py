"""The incremental mixture on synthetic mixtures: recovery, agreement with batch EM,
masked marginals, exact contributions, bounded memory."""
from __future__ import annotations

import resource

import numpy as np
import pytest
from scipy.stats import multivariate_normal

from fleetscope.streams.model import JobModel, ModelConfig
from fleetscope.streams.model.feature_index import FeatureIndex
from fleetscope.streams.model.gmm import GaussianMixture, GMMConfig

D = 8
TRUE_W = np.array([0.5, 0.3, 0.2])


def mixture(n: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    means = np.array([np.full(D, -3.0), np.zeros(D), np.full(D, 3.0)]) + rng.normal(0, 0.5, (3, D))
    sd = rng.uniform(0.5, 1.0, (3, D))
    z = rng.choice(3, n, p=TRUE_W)
    return means[z] + sd[z] * rng.standard_normal((n, D)), means, sd


def stream(g: GaussianMixture, X: np.ndarray, batch: int = 100) -> None:
    M = np.ones_like(X, bool)
    for i in range(0, len(X), batch):
        g.partial_fit(X[i:i + batch], M[i:i + batch])


def matched(g: GaussianMixture, means: np.ndarray) -> np.ndarray:
    """Index of the learned component nearest each true mean."""
    return np.array([np.argmin(((g.means - m) ** 2).sum(1)) for m in means])


@pytest.mark.parametrize("cov", ["diag", "full"])
def test_fixed_k_recovers_means_and_weights(cov):
    X, means, _ = mixture(40_000)
    g = GaussianMixture(GMMConfig(covariance=cov, k=3, eta_min=0.0), D)
    stream(g, X)
    idx = matched(g, means)
    assert len(set(idx)) == 3
    np.testing.assert_allclose(g.weights[idx], TRUE_W, atol=0.02)
    np.testing.assert_allclose(g.means[idx], means, atol=0.1)


def test_grown_mixture_finds_the_three_modes():
    X, means, _ = mixture(40_000)
    g = GaussianMixture(GMMConfig(k=None, max_components=8, eta_min=0.0), D)
    stream(g, X)
    idx = matched(g, means)
    assert len(set(idx)) == 3
    np.testing.assert_allclose(g.means[idx], means, atol=0.15)
    # stray components may exist, but the three modes carry (almost) all weight
    np.testing.assert_allclose(g.weights[idx], TRUE_W, atol=0.03)


def test_a_new_mode_spawns_a_component():
    """Mode A only, then a far mode B appears: B's rows are poorly explained and spawn."""
    X, means, _ = mixture(60_000)
    rng = np.random.default_rng(4)
    z = np.argmin(((X[:, None, :] - means[None]) ** 2).sum(2), axis=1)
    a, b = X[z == 0][:10_000], X[z == 2][:10_000]
    g = GaussianMixture(GMMConfig(k=None, init_components=1, max_components=4, eta_min=0.01), D)
    stream(g, a)
    assert g.n_components == 1
    mixed = np.vstack([a[:5000], b[:5000]])[rng.permutation(10_000)]
    stream(g, mixed)
    idx = matched(g, means[[0, 2]])
    assert len(set(idx)) == 2
    np.testing.assert_allclose(g.means[idx], means[[0, 2]], atol=0.15)


# Stated margin: the streaming fit's mean held-out log-likelihood is within
# 0.05 nats per vector (8 dims) of batch EM run to convergence on the same data.
LL_MARGIN = 0.05


@pytest.mark.parametrize("cov,k", [("diag", 3), ("full", 3), ("diag", None)])
def test_stepwise_loglik_matches_batch_em(cov, k):
    X, _, _ = mixture(50_000)
    train, test = X[:40_000], X[40_000:]
    Mt = np.ones_like(test, bool)
    online = GaussianMixture(GMMConfig(covariance=cov, k=k, eta_min=0.0), D)
    stream(online, train)
    batch = GaussianMixture(GMMConfig(covariance=cov, k=3, seed=7), D)
    batch.fit_batch(train, np.ones_like(train, bool), iters=300)
    ll_online = -online.score(test, Mt).nll.mean()
    ll_batch = -batch.score(test, Mt).nll.mean()
    assert abs(ll_online - ll_batch) < LL_MARGIN, (ll_online, ll_batch)


@pytest.mark.parametrize("cov", ["diag", "full"])
def test_masked_score_is_the_marginal_density(cov):
    X, _, _ = mixture(20_000)
    g = GaussianMixture(GMMConfig(covariance=cov, k=3, eta_min=0.0), D)
    stream(g, X)
    rng = np.random.default_rng(3)
    Z = X[:50].copy()
    M = rng.random(Z.shape) < 0.6
    M[:, 0] = True
    Z[~M] = 0.0
    got = g.score(Z, M).nll
    for i in range(len(Z)):
        o = np.flatnonzero(M[i])
        dens = 0.0
        for k in range(g.n_components):
            cov_k = g.cov[k][np.ix_(o, o)] if cov == "full" else np.diag(g.var[k, o])
            dens += g.weights[k] * multivariate_normal(g.means[k, o], cov_k).pdf(Z[i, o])
        assert got[i] == pytest.approx(-np.log(dens), rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("cov", ["diag", "full"])
def test_learning_with_missing_cells_recovers_means(cov):
    X, means, _ = mixture(40_000)
    rng = np.random.default_rng(5)
    # sources go missing as blocks: a few mask patterns, each row has one (about 30% of cells masked)
    patterns = np.array([[True] * D, [True] * 4 + [False] * 4, [False] * 4 + [True] * 4, [True, False] * 4])
    M = patterns[rng.choice(4, len(X), p=[0.4, 0.2, 0.2, 0.2])]
    Z = np.where(M, X, 0.0)
    g = GaussianMixture(GMMConfig(covariance=cov, k=3, eta_min=0.0), D)
    for i in range(0, len(X), 100):
        g.partial_fit(Z[i:i + 100], M[i:i + 100])
    idx = matched(g, means)
    np.testing.assert_allclose(g.means[idx], means, atol=0.15)
    np.testing.assert_allclose(g.weights[idx], TRUE_W, atol=0.03)


@pytest.mark.parametrize("cov", ["diag", "full"])
def test_contributions_decompose_the_responsible_components_nll(cov):
    X, _, _ = mixture(20_000)
    g = GaussianMixture(GMMConfig(covariance=cov, k=3, eta_min=0.0), D)
    stream(g, X)
    Z = X[:200].copy()
    M = np.random.default_rng(2).random(Z.shape) < 0.8
    Z[~M] = 0.0
    Z[:20, 2] += np.where(M[:20, 2], 8.0, 0.0)                # planted: dim 2 far off
    sc = g.score(Z, M)
    C = g.contributions(Z, M, sc)
    assert (C[~M] == 0).all()
    comp = sc.resp.argmax(1)
    logn, _, _ = g._log_dens(Z, M)
    np.testing.assert_allclose(C.sum(1), -logn[np.arange(len(Z)), comp], rtol=1e-9, atol=1e-9)
    planted = np.flatnonzero(M[:20, 2])
    if cov == "diag":
        assert (C[planted].argmax(1) == 2).all()
    else:   # the symmetric split can share blame with correlated dims; the planted one leads
        assert (np.argsort(-C[planted], axis=1)[:, :2] == 2).any(axis=1).all()
        assert (C[planted].argmax(1) == 2).mean() >= 0.9


def test_feature_index_is_stable_and_bounded():
    fi = FeatureIndex(max_features=3)
    _, X, M = fi.matrix([(0, {"a": 1.0, "b": 2.0}), (1, {"b": 3.0})])
    assert fi.names == ["a", "b"] and M.tolist() == [[True, True], [False, True]]
    assert np.isnan(X[1, 0])
    _, X, M = fi.matrix([(0, {"c": 1.0, "d": 5.0, "e": 6.0, "a": float("nan")})])
    assert fi.names == ["a", "b", "c"]                  # d, e beyond max_features
    assert fi.ignored_values == 2 and fi.ignored_names == ["d", "e"]
    assert fi.nonfinite_values == 1 and not M[0, 0]


def test_streaming_1e5_vectors_keeps_memory_bounded():
    """1e5 vectors (1,000 windows x 100 ranks x 40 features) through the facade."""
    cfg = ModelConfig(detectors=("gmm", "peer"), max_components=8)
    model = JobModel(cfg)
    rng = np.random.default_rng(0)
    names = [f"f{j}" for j in range(40)]
    base = 10 ** rng.uniform(0, 4, 40)
    sizes = []
    for w in range(1000):
        X = base * (1 + 0.03 * rng.standard_normal((100, 40)))
        rows = [(r, dict(zip(names, row))) for r, row in enumerate(X.tolist())]
        model.process_window(w, rows)
        if w == 100:
            peak_100 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if w >= 100:
            mixture = model.detectors["gmm"].mixture
            sizes.append((model.memory_bytes(), mixture.nbytes(), mixture.n_components))
    peak_end = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    total, gmm, ks = (np.array(c) for c in zip(*sizes))
    # the mixture's arrays scale with K (<= max_components) and nothing else; the rest is constant
    assert ks.max() <= cfg.max_components
    assert (gmm == gmm[ks == ks[0]][0] * ks // ks[0]).all()
    assert np.unique(total - gmm).size == 1
    # beside it, the peer detector's per-rank offsets (peers.RankOffsets): fixed per (rank, feature) cell
    offsets = model.detectors["peer"].offsets.nbytes()
    assert offsets == 100 * 40 * (5 + 3) * 8
    assert total.max() - offsets < 64 * 1024, total.max()
    # and the process itself did not grow while 9e4 more vectors streamed through (KiB)
    assert peak_end - peak_100 < 8 * 1024, peak_end - peak_100


@pytest.mark.parametrize("cov", ["diag", "full"])
def test_cached_density_terms_follow_every_parameter_change(cov):
    """score reuses per-M-step terms (1/var, log var, factorizations): after each kind of
    update it must equal a fresh mixture loaded with the same statistics."""
    X, _, _ = mixture(3000)
    M = np.random.default_rng(6).random(X.shape) < 0.8
    Z = np.where(M, X, 0.0)
    g = GaussianMixture(GMMConfig(covariance=cov, k=None, eta_min=0.0), D)

    def same_as_fresh():
        fresh = GaussianMixture(GMMConfig(covariance=cov, k=None), D)
        fresh.load(*g.state())
        for mask in (M[:50], np.ones_like(M[:50])):
            a, b = g.score(Z[:50], mask), fresh.score(Z[:50], mask)
            np.testing.assert_allclose(a.nll, b.nll, rtol=1e-12)
            np.testing.assert_allclose(g.contributions(Z[:50], mask, a), fresh.contributions(Z[:50], mask, b),
                                       rtol=1e-12)

    for i in range(0, 3000, 100):
        g.score(Z[i:i + 100], M[i:i + 100])          # fill the caches, then move the parameters
        g.partial_fit(Z[i:i + 100], M[i:i + 100])
    same_as_fresh()
    g.score(Z[:50], M[:50])
    g.affine(np.full(D, 1.5), np.full(D, 0.5), np.arange(D) < 4, np.arange(D) == 7)
    same_as_fresh()
    g.score(Z[:50], M[:50])
    g.grow(D + 2)
    assert g.score(np.zeros((3, D + 2)), np.ones((3, D + 2), bool)).nll.shape == (3,)


def test_feature_index_layouts_orders_and_odd_values():
    fi = FeatureIndex()
    rows = [(r, {"a": 1.0 + r, "b": 2.0, "c": 3.0}) for r in range(4)]
    ranks, X, M = fi.matrix(rows)                       # one layout, in dimension order
    assert ranks.tolist() == [0, 1, 2, 3] and X[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0] and M.all()
    X[0, 0] = -1.0                                      # the caller owns X
    _, X2, _ = fi.matrix([(0, {"c": 3.0, "b": 2.0, "a": 1.0}), (1, {"c": 6.0, "b": 5.0, "a": 4.0})])
    assert X2.tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]    # one layout, permuted
    _, X3, M3 = fi.matrix([(0, {"a": "7.5", "b": 1, "c": True}), (1, {"b": np.float32(0.5), "a": None})])
    assert X3[0].tolist() == [7.5, 1.0, 1.0] and X3[1, 1] == 0.5
    assert M3.tolist() == [[True, True, True], [False, True, False]]   # None: not a measurement
    assert fi.nonfinite_values == 1


def test_frozen_standardizer_skips_learning_until_a_new_feature_arrives():
    from fleetscope.streams.model.scaling import MaskedStandardizer
    s = MaskedStandardizer(min_obs=2, freeze_obs=4)
    s.grow(2)
    X = np.array([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0]])
    assert s.update(X, np.ones_like(X, bool)) is not None
    before = s.transform(X, np.ones_like(X, bool))
    assert s.update(X + 5.0, np.ones_like(X, bool)) is None         # frozen: nothing learned
    np.testing.assert_array_equal(s.transform(X, np.ones_like(X, bool)), before)
    s.grow(3)
    X3 = np.hstack([X, np.full((4, 1), 7.0)])
    change = s.update(X3, np.ones_like(X3, bool))                   # the new dim still learns
    assert change is not None and change.fresh.tolist() == [False, False, True]
    assert s.count.tolist() == [4.0, 4.0, 4.0] and s.mean[2] == 7.0
    Z = s.transform(X3, np.array([[True, False, True]] * 4))
    assert (Z[:, 1] == 0).all() and np.allclose(Z[:, 0], before[:, 0])
