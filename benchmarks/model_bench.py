"""Anomaly-model throughput and memory on one core.

Goal (issue 5): score at least 50,000 feature vectors/s per core with 64
features, K=8, diagonal covariance. The same run times, on the same vectors:
 - the mixture's vectorized score (NLL) and score + per-feature contributions,
   in mini-batches of 8 (one window of an 8-rank job), 100 and 1,000 rows;
 - a per-vector loop over the same numpy parameters (what "no Python loop
   over samples" avoids), and river's HalfSpaceTrees score_one (the ensemble's
   comparison detector): the ratios say what vectorizing buys;
 - the whole facade, JobModel.process_window, on dict rows (100 ranks x 64
   features a window; gmm + peer, the default rule's detectors): feature
   mapping, standardization, scoring, thresholds, learning, top-k output;
 - memory_bytes and checkpoint size after streaming 1e5 vectors.
BLAS is pinned to one thread ("per core"). Writes benchmarks/results/model.json.
"""
from __future__ import annotations

import os

for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"

import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from river.anomaly import HalfSpaceTrees  # noqa: E402

from streams.model import JobModel, ModelConfig  # noqa: E402
from streams.model.gmm import GaussianMixture, GMMConfig  # noqa: E402

D, K, GOAL = 64, 8, 50_000


def rate(fn, n_vectors: int, min_s: float = 1.0) -> float:
    """Vectors per second of fn() (which handles n_vectors), best of repeated runs over min_s."""
    fn()
    best, spent = 0.0, 0.0
    while spent < min_s:
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        spent += dt
        best = max(best, n_vectors / dt)
    return best


def trained_mixture(rng) -> tuple[GaussianMixture, np.ndarray]:
    centers = rng.normal(0, 2, (K, D))
    X = centers[rng.integers(K, size=40_000)] + rng.standard_normal((40_000, D))
    g = GaussianMixture(GMMConfig(covariance="diag", k=K, eta_min=0.0), D)
    M = np.ones_like(X, bool)
    for i in range(0, len(X), 500):
        g.partial_fit(X[i:i + 500], M[i:i + 500])
    assert g.n_components == K
    return g, X


def per_vector_loop(g: GaussianMixture, X: np.ndarray) -> np.ndarray:
    out = np.empty(len(X))
    logw = np.log(g.weights)
    for i, x in enumerate(X):
        lp = logw - 0.5 * (np.log(2 * np.pi * g.var) + (x - g.means) ** 2 / g.var).sum(axis=1)
        m = lp.max()
        out[i] = -(m + np.log(np.exp(lp - m).sum()))
    return out


def main() -> dict:
    rng = np.random.default_rng(0)
    g, X = trained_mixture(rng)
    batches = []
    for b in (8, 100, 1000):
        Xb = X[:b]
        Mb = np.ones_like(Xb, bool)
        reps = max(1, 10_000 // b)
        score = rate(lambda: [g.score(Xb, Mb) for _ in range(reps)], b * reps)
        both = rate(lambda: [g.contributions(Xb, Mb, g.score(Xb, Mb)) for _ in range(reps)], b * reps)
        batches.append({"rows_per_batch": b, "score_vectors_per_s": round(score),
                        "score_and_contributions_vectors_per_s": round(both), "meets_goal": both >= GOAL})
    Xl = X[:2000]
    ref = g.score(Xl, np.ones_like(Xl, bool)).nll
    assert np.allclose(per_vector_loop(g, Xl), ref)
    loop = rate(lambda: per_vector_loop(g, Xl), len(Xl))

    lo, hi = X.min(0), X.max(0)
    dicts = [dict(enumerate(r)) for r in ((X[:3000] - lo) / (hi - lo)).tolist()]
    hst = HalfSpaceTrees(n_trees=10, height=8, window_size=250, seed=0)
    for x in dicts[:1000]:
        hst.learn_one(x)
    hst_rate = rate(lambda: [hst.score_one(x) for x in dicts[1000:]], 2000)

    # the facade, dict rows in, WindowScores out
    names = [f"f{j}" for j in range(D)]
    base = 10 ** rng.uniform(0, 5, D)
    ranks = 100
    windows = []
    for w in range(1000):
        V = base * (1 + 0.03 * rng.standard_normal((ranks, D)))
        windows.append([(r, dict(zip(names, row))) for r, row in enumerate(V.tolist())])
    model = JobModel(ModelConfig(detectors=("gmm", "peer"), max_components=K))
    t = time.perf_counter()
    for w, rows in enumerate(windows):
        model.process_window(w, rows)
    facade = ranks * len(windows) / (time.perf_counter() - t)
    blob = model.to_bytes()
    t = time.perf_counter()
    JobModel.from_bytes(blob)
    restore_ms = (time.perf_counter() - t) * 1000

    best = max(b["score_and_contributions_vectors_per_s"] for b in batches)
    return {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
                    "blas_threads": 1},
        "setup": {"features": D, "components": K, "covariance": "diag"},
        "goal_vectors_per_s": GOAL,
        "mixture_scoring": batches,
        "baselines": {
            "per_vector_numpy_loop_vectors_per_s": round(loop),
            "river_halfspacetrees_score_one_vectors_per_s": round(hst_rate),
            "vectorized_1000_vs_loop_ratio": round(batches[-1]["score_vectors_per_s"] / loop, 1),
            "vectorized_1000_vs_hst_ratio": round(batches[-1]["score_vectors_per_s"] / hst_rate, 1),
        },
        "facade_process_window": {
            "ranks_per_window": ranks, "windows": len(windows), "detectors": ["gmm", "peer"],
            "vectors_per_s": round(facade), "meets_goal": facade >= GOAL,
        },
        "memory_after_1e5_vectors": {
            "memory_bytes": model.memory_bytes(), "components": model.gmm.n_components,
            "checkpoint_bytes": len(blob), "restore_ms": round(restore_ms, 2),
        },
        "meets_goal": best >= GOAL,
    }


if __name__ == "__main__":
    result = main()
    out = Path(__file__).resolve().parent / "results" / "model.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
