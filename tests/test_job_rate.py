"""The job against its own history (streams/model/job_rate.py) on the rank vectors a real run produced.

tests/recorded/dataloader_stall_rank_vectors_2.json.gz: the worker's rank vectors of a dev dataloader_stall run
(3 gloo ranks; rank 1 reads each batch from disk at 30-60 s, so the whole job runs at a quarter of its rate);
its collective rate is torch_collectives_per_s, from the always-on gloo marks."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from fleetscope.streams.model.job_rate import JobRates

RECORDED = Path(__file__).parent / "recorded" / "dataloader_stall_rank_vectors_2.json.gz"


def test_a_job_slowed_by_its_stalled_rank_is_flagged_and_its_recovery_is_not():
    """The stall is a fall: flagged from its first windows until the slow rate is accepted as the job's regime
    (regime_windows). The job back at its old rate afterwards is faster than that regime, not slower: before
    only falls counted, the recovery was 19 windows of `job` flags on every rank."""
    doc = json.loads(gzip.open(RECORDED, "rt").read())
    rates = JobRates(warmup=15, regime_windows=20)
    flagged, named = {}, {}
    for w in doc["windows"]:
        k = round(w["t_s"])
        result = rates.step(("acme", "train"), round((1000 + w["t_s"]) * 1e9), [v for _, v in w["ranks"]])
        if result is not None:
            flagged[k] = result.flagged
            named[k] = result.rate_feature
    assert named[40] == "torch_collectives_per_s"
    assert sum(flagged.get(k, False) for k in range(31, 50)) >= 15
    after = [k for k in range(61, 91) if flagged.get(k)]
    assert not after, after
    assert not any(flagged.get(k) for k in range(0, 29))


def test_with_the_scorers_default_a_slowdown_stays_flagged_while_it_lasts():
    """The worker's job rates accept a slow rate as the job's normal only after slowdown_regime_windows: the
    whole 30 s stall is flagged, not its first 20 windows (regime_windows, as before: the alarm ended while the
    job still ran at a quarter of its rate), and the recovery still is not."""
    from fleetscope.streams.model import ModelConfig
    doc = json.loads(gzip.open(RECORDED, "rt").read())
    rates = JobRates(warmup=15, regime_windows=ModelConfig().slowdown_regime_windows)
    flagged = {}
    for w in doc["windows"]:
        result = rates.step(("acme", "train"), round((1000 + w["t_s"]) * 1e9), [v for _, v in w["ranks"]])
        if result is not None:
            flagged[round(w["t_s"])] = result.flagged
    stall = [k for k in range(31, 60) if k in flagged]
    assert sum(flagged[k] for k in stall) >= len(stall) - 2, [k for k in stall if not flagged[k]]
    assert sum(flagged.get(k, False) for k in range(52, 60)) >= 6     # past the old 20-window cut
    assert not [k for k in range(61, 91) if flagged.get(k)]
    assert rates.counts["regimes"] == 0
