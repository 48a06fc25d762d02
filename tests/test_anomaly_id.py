"""Anomaly ids (src/fleetscope/anomaly_id.py): TENANT/JOB/RANK/WINDOW_START_NS, read from both ends so a job
name holding "/" survives, and malformed ids refused with what is wrong."""
from __future__ import annotations

import pytest

from fleetscope.anomaly_id import AnomalyId, parse_anomaly_id


@pytest.mark.parametrize("aid", [AnomalyId("acme", "train-1", 2, 1_700_000_000_000_000_000),
                                 AnomalyId("acme", "team/a/train", 0, 5), AnomalyId("_node", "n1", -1, 7)])
def test_an_id_reads_back_to_its_parts(aid):
    assert parse_anomaly_id(str(aid)) == aid


@pytest.mark.parametrize("text, says", [
    ("acme/train/2", "is not TENANT/JOB/RANK/WINDOW_START_NS"),
    ("/train/2/5", "is not"), ("acme//2/5", "is not"),
    ("acme/train/two/5", "must be integers"), ("acme/train/2/5.5", "must be integers"),
    ("acme/train/2/0", "must be positive"),
])
def test_a_malformed_id_is_refused_with_the_reason(text, says):
    with pytest.raises(ValueError, match=says):
        parse_anomaly_id(text)
