"""Fingerprint metrics (streams/diagnosis/metrics.py) over one evaluated run.

The metrics need the matcher's verdict on every window, flagged or not. A flagged
window is matched from its stored anomaly row (contributions, peer z-scores, vector),
exactly as the stream did; an unflagged one from its stored feature vector joined with
its host's node features (as the scorer joins them), with no contributions or peer
z-scores, since the stream computes those only for what it flags.
Windows the scorer ignores (onset and recovery grace) are left out.
"""
from __future__ import annotations

from fleetscope.eval.scorer import Truth, label


def run_fingerprint_metrics(truth: Truth, t0: float, data: dict, *, onset_grace_s: float = 0.0,
                            recovery_grace_s: float = 0.0) -> dict:
    from fleetscope.eval.runner import window_of
    from fleetscope.streams.diagnosis.anomaly import Anomaly
    from fleetscope.streams.diagnosis.kb import load_kb
    from fleetscope.eval.fingerprint_metrics import fingerprint_metrics, outcome
    kb = load_kb()
    w = truth.window_s
    flagged = {(r, ws) for r, ws, _, _, a, _ in data["scores"] if a}
    stored = {(r, ws): row for r, ws, *row in data["anomalies"]}
    node = {(host, ws): f for host, ws, f in data["node"]}
    outcomes = []
    for r, ws, host, feat in data["features"]:
        k = window_of(ws, t0, w)
        if r not in truth.ranks or not 0 <= k < truth.n_windows:
            continue
        lab = label(truth, r, k, onset_grace_s=onset_grace_s, recovery_grace_s=recovery_grace_s)
        if lab == "ignored":
            continue
        if (r, ws) in stored:
            h, score, thr, dets, contrib, pz, vec = stored[r, ws]
            a = Anomaly("eval", "eval", h, r, ws, score, thr, list(dets), dict(contrib), dict(pz), dict(vec))
        else:
            vec = {**node.get((host, ws), {}), **feat}
            a = Anomaly("eval", "eval", host, r, ws, 0.0, 0.0, [], {}, {}, vec)
        outcomes.append(outcome(a, truth.kb_entry if lab == "positive" else None, (r, ws) in flagged, kb))
    return fingerprint_metrics(outcomes).as_dict()
