"""Match an anomaly to KB entries, each with a confidence in [0, 1].

An entry is a candidate only when the anomaly's role is one it explains
(`roles`) and its rules pass: every `all` condition holds, if it has
`any` conditions at least one does, and none of its `unless` conditions does; or, failing
that, the same holds for one of its `or` blocks (the first that does counts). A masked input
makes its condition false, so an entry never matches on missing data. Its `support` conditions
decide nothing; where they hold they raise the rule part.

confidence = 0.5 * rule_part + 0.5 * pattern_part, where
- rule_part    = (conditions that held) / (conditions of the block that held,
                 with the entry's `support`), so an entry whose `any` and
                 `support` conditions all hold is surer;
- pattern_part = max(0, cosine similarity of the window's fingerprint and
                 the entry's fingerprint pattern).

A loud failure is the diagnosis when it is there: an entry that holds on a
loud feature (a crashed or vanished rank, a stalled collective, new ECC
errors, an XID) has confidence 1: the failure itself was observed, not
inferred. So it ranks ahead of every entry that does not, for every reader
that takes the most confident row (the store keeps no order). A crashed
rank's last window is often odd to the model too (the dev scenarios'
crash_one_rank: its IRQs and preemption made irq_locality_miss the top
entry at 0.49, crashed_rank below it).

An anomaly that no entry accepts is diagnosed as "unmatched" (confidence 0)
and keeps its evidence: the top attributed features.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from fleetscope.streams.diagnosis.anomaly import Anomaly
from fleetscope.streams.diagnosis.attribution import Attribution, attribute
from fleetscope.streams.diagnosis.fingerprint import similarity
from fleetscope.streams.diagnosis.kb import UNMATCHED, Entry
from fleetscope.streams.feature_catalogue import LOUD_FEATURES

LOUD = LOUD_FEATURES | {"gpu_xid_count"}   # the features of the loud failures (streams/model/loud.py, XIDs)


@dataclass(frozen=True)
class Match:
    entry: str
    confidence: float
    similarity: float                # fingerprint vs pattern, in [-1, 1]
    held: tuple[str, ...]            # the conditions that held, as text
    evidence: dict[str, float] = field(default_factory=dict)
    loud: bool = False               # a condition on a loud feature held: confidence 1


@dataclass
class Diagnosis:
    anomaly: Anomaly
    attribution: Attribution
    matches: list[Match]             # best first; empty means unmatched

    @property
    def best(self) -> str:
        return self.matches[0].entry if self.matches else UNMATCHED

    @property
    def confidence(self) -> float:
        return self.matches[0].confidence if self.matches else 0.0

    def rows(self) -> list[Match]:
        """What gets stored and published: every match, or one `unmatched`."""
        if self.matches:
            return list(self.matches)
        top = {fs.feature: fs.weight * fs.sign for fs in self.attribution.top}
        return [Match(UNMATCHED, 0.0, 0.0, (), evidence_of(self.anomaly, list(top)) | _prefixed("share.", top))]


def match_entry(entry: Entry, anomaly: Anomaly, attribution: Attribution) -> Match | None:
    feats, peers = anomaly.features, anomaly.peer_z
    if not entry.explains_role(anomaly.role):
        return None
    if any(c.holds(feats, peers) for c in entry.unless_rules):
        return None
    for block in entry.blocks:
        any_held = [c for c in block.any_rules if c.holds(feats, peers)]
        if all(c.holds(feats, peers) for c in block.all_rules) and (any_held or not block.any_rules):
            break
    else:
        return None
    support_held = [c for c in entry.support_rules if c.holds(feats, peers)]
    held = [c.describe() for c in (*block.all_rules, *any_held, *support_held)]
    loud = any(c.name in LOUD for c in (*block.all_rules, *any_held))
    rule_part = len(held) / (len(block.all_rules) + len(block.any_rules) + len(entry.support_rules))
    sim = similarity(attribution.fingerprint, entry.fingerprint)
    confidence = 1.0 if loud else 0.5 * rule_part + 0.5 * max(0.0, sim)
    return Match(entry.name, round(confidence, 6), round(sim, 6), tuple(held), evidence_of(anomaly, entry.evidence),
                 loud)


def diagnose(anomaly: Anomaly, kb: Mapping[str, Entry], min_confidence: float = 0.0,
             attribution: Attribution | None = None) -> Diagnosis:
    """Attribute the anomaly and rank every KB entry that accepts it."""
    attribution = attribution or attribute(anomaly.contributions, anomaly.peer_z)
    matches = [m for entry in kb.values()
               if (m := match_entry(entry, anomaly, attribution)) is not None and m.confidence >= min_confidence]
    matches.sort(key=lambda m: (not m.loud, -m.confidence, -len(m.held), m.entry))
    return Diagnosis(anomaly, attribution, matches)


def evidence_of(anomaly: Anomaly, names) -> dict[str, float]:
    """Feature values and their peer z-scores (`peer_z.<name>`); masked ones are left out."""
    out: dict[str, float] = {}
    for name in names:
        if name in anomaly.features:
            out[name] = float(anomaly.features[name])
        if name in anomaly.peer_z:
            out[f"peer_z.{name}"] = float(anomaly.peer_z[name])
    return out


def _prefixed(prefix: str, d: Mapping[str, float]) -> dict[str, float]:
    return {prefix + k: float(v) for k, v in d.items()}
