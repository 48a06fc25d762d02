"""TopFeatures ranks one row on demand: the k largest present cells by key, in descending order."""
import numpy as np

from fleetscope.streams.model.config import WindowScore
from fleetscope.streams.model.top_features import TopFeatures


def brute(values, present, by, names, k, i):
    cells = sorted((j for j in range(values.shape[1]) if present[i, j]), key=lambda j: -by[i, j])[:k]
    return {names[j]: values[i, j] for j in cells}


def test_matches_a_full_sort_with_masking_and_short_rows():
    rng = np.random.default_rng(3)
    n, d, k = 40, 12, 5
    values = rng.standard_normal((n, d))
    by = np.abs(values)
    present = rng.random((n, d)) > 0.3
    present[7] = False                 # nothing present
    present[8] = False
    present[8, [2, 9]] = True          # fewer than k present
    names = np.array([f"f{j}" for j in range(d)], dtype=object)
    top = TopFeatures(values, present, by, names, k)
    for i in range(n):
        got = top.row(i)
        want = brute(values, present, by, names, k, i)
        assert list(got) == list(want) and got == want
    assert top.row(7) == {} and list(top.row(8)) == sorted(["f2", "f9"], key=lambda f: -by[8, int(f[1:])])


def test_window_score_reads_its_own_row_and_caches_it():
    values = np.array([[1.0, 5.0, 3.0], [9.0, 2.0, 4.0]])
    names = np.array(["a", "b", "c"], dtype=object)
    top = TopFeatures(values, np.ones_like(values, bool), values, names, 2)
    s0 = WindowScore(0, 1.0, None, False, [], top, {}, False, 0)
    s1 = WindowScore(1, 1.0, None, False, [], top, {}, False, 1)
    assert list(s0.contributions.items()) == [("b", 5.0), ("c", 3.0)]
    assert list(s1.contributions.items()) == [("a", 9.0), ("c", 4.0)]
    assert s1.contributions is s1.contributions and s0.peer_z == {}
