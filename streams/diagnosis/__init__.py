"""Diagnosis: what an anomaly means and what to do about it.

anomaly.Anomaly (the model's output) -> attribution (signed subsystem
shares) -> fingerprint (a normalized vector in a fixed subsystem order) ->
matcher (KB entries from kb/*.yaml, each with a confidence, or "unmatched")
-> remediation (dry run by default; execution needs per-entry and per-host
opt-in). metrics.py scores how well signatures line up with injected faults.
"""
