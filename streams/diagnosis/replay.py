"""Diagnose a job's stored anomalies again, with another knowledge base: what a KB edit would have said.

The `anomalies` table keeps what the matcher read when the window was flagged (features, peer z-scores,
contributions, role), so an entry's rules and fingerprint can be tried against a job's history before the
edit is deployed: every alerted anomaly (all but role `waiting`, which the pipeline never diagnoses) is
diagnosed with the given KB and set beside the top entry stored for it then (`diagnoses`).

Read-only: nothing is written to the store.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping

from fleetscope.streams.diagnosis.anomaly import Anomaly
from fleetscope.streams.diagnosis.kb import Entry
from fleetscope.streams.diagnosis.matcher import diagnose
from fleetscope.streams.model.roles import WAITING

ANOMALIES_SQL = """
SELECT tenant, host, rank, toUnixTimestamp64Nano(window_start) AS window_ns, score, threshold, detectors, role,
       contributions, peer_z, feature
FROM anomalies FINAL
WHERE job = {job:String} AND role != {waiting:String}
  AND window_start >= fromUnixTimestamp64Milli({since_ms:Int64}) {tenant_clause}
ORDER BY window_start, tenant, host, rank
"""

STORED_TOP_SQL = """
SELECT tenant, host, rank, toUnixTimestamp64Nano(window_start) AS window_ns, argMax(kb_entry, confidence) AS top
FROM diagnoses FINAL
WHERE job = {job:String} AND window_start >= fromUnixTimestamp64Milli({since_ms:Int64}) {tenant_clause}
GROUP BY tenant, host, rank, window_start
"""


@dataclass(frozen=True)
class Replayed:
    tenant: str
    host: str
    rank: int
    window_ns: int
    role: str
    stored: str          # the top entry stored when the window was flagged ("" if none was stored)
    replayed: str        # the top entry of the given KB
    confidence: float    # of the replayed top entry

    @property
    def changed(self) -> bool:
        return self.stored != self.replayed


@dataclass
class ReplayResult:
    rows: list[Replayed] = field(default_factory=list)

    @property
    def changed(self) -> list[Replayed]:
        return [r for r in self.rows if r.changed]

    def by_rank(self) -> dict[int, dict[str, Counter]]:
        """Per rank: how often each entry was on top, stored and replayed."""
        out: dict[int, dict[str, Counter]] = {}
        for r in self.rows:
            d = out.setdefault(r.rank, {"stored": Counter(), "replayed": Counter()})
            d["stored"][r.stored or "(none stored)"] += 1
            d["replayed"][r.replayed] += 1
        return dict(sorted(out.items()))


def replay(store, kb: Mapping[str, Entry], job: str, since_ms: int, tenant: str | None = None) -> ReplayResult:
    params = {"job": job, "since_ms": int(since_ms), "waiting": WAITING}
    clause = ""
    if tenant:
        clause, params["tenant"] = "AND tenant = {tenant:String}", tenant
    stored = {(t, h, int(r), int(w)): top for t, h, r, w, top in
              store.query(STORED_TOP_SQL.replace("{tenant_clause}", clause), params).rows}
    result = ReplayResult()
    for t, h, rank, ws, score, threshold, detectors, role, contributions, peer_z, features in \
            store.query(ANOMALIES_SQL.replace("{tenant_clause}", clause), params).rows:
        anomaly = Anomaly(t, job, h, int(rank), int(ws), float(score), float(threshold), list(detectors),
                          _floats(contributions), _floats(peer_z), _floats(features), role)
        d = diagnose(anomaly, kb)
        result.rows.append(Replayed(t, h, int(rank), int(ws), role, stored.get((t, h, int(rank), int(ws)), ""),
                                    d.best, d.confidence))
    return result


def _floats(m: Mapping) -> dict[str, float]:
    return {str(k): float(v) for k, v in dict(m).items()}
