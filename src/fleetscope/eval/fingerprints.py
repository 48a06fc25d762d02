"""Fingerprint metrics (eval/fingerprint_metrics.py) over one evaluated run, over every window.

The metrics need the matcher's verdict on every window, flagged or not, from inputs of the
same kind. A flagged window is matched from its stored anomaly row (contributions, peer
z-scores, vector), exactly as the stream did. An unflagged one has no stored anomaly: the
stream computes contributions and peer z-scores only for what it flags. Matching it with
empty peer z-scores (as this did before) lets no peer-based rule fire on it, which biases
healthy contamination down. So an unflagged window gets peer z-scores recomputed from the
same window's ranks: for each feature, (x - median over the job's ranks) / (1.4826 * MAD),
with MAD floored at PEER_MAD_FLOOR of the median's size. That is a stateless stand-in for
the stream's learned peer scaler, not the same numbers; contributions stay empty (they come
from the model's score, which only the stream has).
Windows the scorer ignores (onset and recovery grace, unscored faults) are left out.
"""
from __future__ import annotations

import statistics
from collections import defaultdict

from fleetscope.eval.scorer import Truth, label
from fleetscope.eval.timegrid import window_of

PEER_MAD_FLOOR = 0.05  # a feature all ranks share exactly would otherwise give infinite z


def peer_z_of(vectors: dict[int, dict]) -> dict[int, dict[str, float]]:
    """rank -> {feature: robust z against the window's other ranks}; needs 3+ ranks per feature."""
    by_feature: dict[str, dict[int, float]] = defaultdict(dict)
    for r, vec in vectors.items():
        for k, v in vec.items():
            if isinstance(v, (int, float)):
                by_feature[k][r] = float(v)
    out: dict[int, dict[str, float]] = {r: {} for r in vectors}
    for k, vals in by_feature.items():
        if len(vals) < 3:
            continue
        med = statistics.median(vals.values())
        mad = statistics.median(abs(v - med) for v in vals.values()) * 1.4826
        scale = max(mad, PEER_MAD_FLOOR * abs(med), 1e-9)
        for r, v in vals.items():
            out[r][k] = (v - med) / scale
    return out


def run_fingerprint_metrics(truth: Truth, t0: float, data: dict, *, onset_grace_s: float = 0.0,
                            recovery_grace_s: float = 0.0) -> dict:
    from fleetscope.streams.diagnosis.anomaly import Anomaly
    from fleetscope.streams.diagnosis.kb import load_kb
    from fleetscope.eval.fingerprint_metrics import fingerprint_metrics, outcome
    kb = load_kb()
    w = truth.window_s
    flagged = {(r, ws) for r, ws, _, _, a, *_ in data["scores"] if a}
    stored = {(r, ws): row for r, ws, *row in data["anomalies"]}
    node = {(host, ws): f for host, ws, f in data["node"]}
    by_window: dict[int, dict[int, tuple]] = defaultdict(dict)
    for r, ws, host, feat in data["features"]:
        by_window[ws][r] = (host, feat)
    outcomes = []
    for ws, ranks in sorted(by_window.items()):
        k = window_of(ws, t0, w)
        if not 0 <= k < truth.n_windows:
            continue
        peers = peer_z_of({r: feat for r, (_, feat) in ranks.items()})
        for r, (host, feat) in sorted(ranks.items()):
            if r not in truth.ranks:
                continue
            lab = label(truth, r, k, onset_grace_s=onset_grace_s, recovery_grace_s=recovery_grace_s)
            if lab == "ignored":
                continue
            if (r, ws) in stored:
                h, score, thr, dets, contrib, pz, vec = stored[r, ws]
                a = Anomaly("eval", "eval", h, r, ws, score, thr, list(dets), dict(contrib), dict(pz), dict(vec))
            else:
                vec = {**node.get((host, ws), {}), **feat}
                a = Anomaly("eval", "eval", host, r, ws, 0.0, 0.0, [], {}, peers.get(r, {}), vec)
            expected = _expected_kb(truth, r, k, onset_grace_s, recovery_grace_s) if lab == "positive" else None
            if lab == "positive" and expected is None:
                continue  # a fault with no KB entry yet (a hang, a crash): neither healthy nor labelled
            outcomes.append(outcome(a, expected, (r, ws) in flagged, kb))
    return fingerprint_metrics(outcomes).as_dict()


def _expected_kb(truth: Truth, rank: int, k: int, onset_grace_s: float, recovery_grace_s: float) -> str | None:
    from fleetscope.eval.scorer import fault_label
    for f in truth.faults:
        if fault_label(truth, f, rank, k, onset_grace_s, recovery_grace_s) == "positive":
            return f.kb_entry
    return None
