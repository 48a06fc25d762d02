"""Our half-space trees keep their state in arrays (checkpoints hold no pickle), and give the
same trees and scores as river's HalfSpaceTrees for the same seed, batch for batch."""
from __future__ import annotations

import numpy as np
from river.anomaly import HalfSpaceTrees as RiverHalfSpaceTrees

from fleetscope.streams.model.half_space_trees import HalfSpaceTrees


def test_scores_equal_rivers_for_the_same_seed_across_window_pivots():
    rng = np.random.default_rng(0)
    d = 7
    ours = HalfSpaceTrees(n_trees=10, height=8, window_size=100, seed=3)
    river = RiverHalfSpaceTrees(n_trees=10, height=8, window_size=100, seed=3)
    X = rng.random((1200, d))
    X[:, 0] = X[:, 0] * 0.1 + 1.0                      # a feature on its own scale
    M = rng.random(X.shape) > 0.05                     # a few masked cells (given as mid-range)
    compared = 0
    for start in range(0, X.shape[0], 37):             # batches that straddle the pivots
        B, Mb = X[start:start + 37], M[start:start + 37]
        got = ours.score(B, Mb)
        want = [river.score_one(dict(enumerate(x))) for x in ours._scaled(B, Mb).tolist()]
        np.testing.assert_array_equal(got, np.asarray(want, float))
        compared += len(B)
        ours.learn(B, Mb, np.ones(len(B), bool))
        # river is fed the rows scaled by the min/max that include this batch, as ours learns them
        for x in ours._scaled(B, Mb).tolist():
            river.learn_one(dict(enumerate(x)))
    assert compared == 1200 and not ours.first_window     # 12 window pivots compared


def test_state_is_plain_arrays_and_round_trips():
    rng = np.random.default_rng(1)
    a = HalfSpaceTrees(n_trees=4, height=5, window_size=20, seed=0)
    X = rng.random((90, 3))
    a.grow(3)
    a.learn(X, np.ones_like(X, bool), np.ones(90, bool))
    meta, arrays = a.state()
    assert all(isinstance(v, np.ndarray) and v.dtype.kind in "fib" for v in arrays.values())
    assert all(type(v) in (int, bool) for v in meta.values())
    b = HalfSpaceTrees(n_trees=4, height=5, window_size=20, seed=0)
    for k, v in arrays.items():
        setattr(b, k, v.copy())
    b.n_features, b.counter, b.first_window = meta["n_features"], meta["counter"], meta["first_window"]
    Y = rng.random((10, 3))
    np.testing.assert_array_equal(a.score(Y, np.ones_like(Y, bool)), b.score(Y, np.ones_like(Y, bool)))
