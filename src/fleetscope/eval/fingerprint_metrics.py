"""Fingerprint metrics in the spirit of Unveil: do signatures name the fault?

Sources: the issue names four metrics from the Unveil paper (signature hit
rate, signature coverage, detection-signature agreement, healthy
contamination). We could not find the paper's text in the reference corpora,
so the definitions below are ours, written to match those names; the lead
should check them against the paper before quoting numbers as "Unveil's".

Inputs: one Outcome per evaluated window (rank, window), from a labelled run
(injected faults, healthy periods):
- label:     the injected fault, as a KB entry name; None for a healthy window;
- detected:  whether the anomaly detector flagged the window;
- signature: the matcher's best KB entry for the window, or "unmatched". The
             matcher runs on every window for this, flagged or not, so that
             detection and signature can be compared.

Let W be all windows, F the faulty ones (label set), H the healthy ones,
C the fault classes present in F, S(w) the signature, D(w) the detection.

- signature hit rate      = |{w in F : S(w) = label(w)}| / |F|
    how often a faulty window's signature names its fault.
- signature coverage      = |{c in C : some w in F with label c has S(w) = c}| / |C|
    the share of injected fault classes the KB recognises at least once.
- detection-signature agreement
                          = |{w in W : D(w) = (S(w) != "unmatched")}| / |W|
    how often the detector and the signatures agree that something is wrong.
- healthy contamination   = |{w in H : S(w) != "unmatched"}| / |H|
    how often a signature fires on a healthy window (lower is better).

A metric whose denominator is empty is None, never 0 or 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from fleetscope.streams.diagnosis.anomaly import Anomaly
from fleetscope.streams.diagnosis.kb import UNMATCHED, Entry
from fleetscope.streams.diagnosis.matcher import diagnose


@dataclass(frozen=True)
class Outcome:
    label: str | None
    detected: bool
    signature: str  # a KB entry name or "unmatched"


@dataclass
class FingerprintMetrics:
    signature_hit_rate: float | None
    signature_coverage: float | None
    detection_signature_agreement: float | None
    healthy_contamination: float | None
    windows: int
    faulty_windows: int
    healthy_windows: int
    per_class_hit_rate: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def fingerprint_metrics(outcomes: Iterable[Outcome]) -> FingerprintMetrics:
    outcomes = list(outcomes)
    faulty = [o for o in outcomes if o.label is not None]
    healthy = [o for o in outcomes if o.label is None]
    per_class: dict[str, list[int]] = {}
    for o in faulty:
        hits_total = per_class.setdefault(o.label, [0, 0])
        hits_total[0] += o.signature == o.label
        hits_total[1] += 1
    hits = sum(h for h, _ in per_class.values())
    return FingerprintMetrics(
        signature_hit_rate=_ratio(hits, len(faulty)),
        signature_coverage=_ratio(sum(1 for h, _ in per_class.values() if h), len(per_class)),
        detection_signature_agreement=_ratio(
            sum(1 for o in outcomes if o.detected == (o.signature != UNMATCHED)), len(outcomes)),
        healthy_contamination=_ratio(sum(1 for o in healthy if o.signature != UNMATCHED), len(healthy)),
        windows=len(outcomes), faulty_windows=len(faulty), healthy_windows=len(healthy),
        per_class_hit_rate={c: h / n for c, (h, n) in sorted(per_class.items())},
    )


def outcome(window: Anomaly, label: str | None, detected: bool, kb: Mapping[str, Entry]) -> Outcome:
    """Run the matcher on one labelled window (flagged or not)."""
    if label is not None and label not in kb:
        raise ValueError(f"label {label!r} is not a KB entry; known: {sorted(kb)}")
    return Outcome(label, bool(detected), diagnose(window, kb).best)


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None
