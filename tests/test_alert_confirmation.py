"""Alert confirmation (streams/model/confirmation.py): K of a rank's last N windows flagged, or no alert.

The end-to-end path (a straggler's first two flagged windows stored unflagged with detector
"unconfirmed", and its alerts kept across a worker restart) is in test_scoring_stream.py; this file
checks the rule itself and its checkpoint part through the real checkpoint container."""
from __future__ import annotations

import pytest

from fleetscope.streams.model import JobModel, ModelConfig
from fleetscope.streams.model import checkpoint
from fleetscope.streams.model.confirmation import AlertConfirmation, parse_confirm
from fleetscope.streams.model.state_archive import CheckpointError

SEC = 10**9
KEY = ("acme", "job-1", "node-a", 3)


def flags_of(conf: AlertConfirmation, pattern: str, key=KEY, start: int = 0) -> str:
    """Feed one window per character ('x' flagged, '.' not); the confirmed ones as a string."""
    return "".join("X" if conf.confirm(key, (start + i) * SEC, c == "x") else "."
                   for i, c in enumerate(pattern))


def test_three_of_five_alerts_from_the_third_flag_and_ignores_lone_blips():
    conf = AlertConfirmation(3, 5, SEC)
    assert flags_of(conf, "x...x...x...") == "............"       # blips, each alone in its five windows
    assert flags_of(conf, "xxxxx.x", start=100) == "..XXX.X"       # a fault: from its third window on
    assert flags_of(conf, "x.x.x", start=200) == "....X"           # three in five, not in a row
    assert flags_of(conf, "xx...xx", start=300) == "......."       # the first two slid out of the five


def test_each_rank_confirms_on_its_own_and_one_of_one_alerts_every_flag():
    conf = AlertConfirmation(2, 2, SEC)
    other = ("acme", "job-1", "node-a", 4)
    assert [conf.confirm(KEY, 0, True), conf.confirm(other, 0, False),
            conf.confirm(KEY, SEC, True), conf.confirm(other, SEC, True)] == [False, False, True, False]
    assert flags_of(AlertConfirmation(*parse_confirm("1 of 1"), SEC), "x.x") == "X.X"


def test_a_window_scored_twice_counts_once_and_idle_keys_are_forgotten():
    conf = AlertConfirmation(2, 3, SEC)
    assert [conf.confirm(KEY, 5 * SEC, True) for _ in range(3)] == [False, False, False]
    assert conf.confirm(KEY, 6 * SEC, False) is False and len(conf) == 1   # the flag of window 5 still counts
    conf.confirm(KEY, 9 * SEC, False)
    assert len(conf) == 0                                                  # nothing flagged in its last three


@pytest.mark.parametrize("text", ["3", "3 of", "0 of 5", "6 of 5", "3 of 61", "three of five", "3 or 5"])
def test_a_malformed_setting_is_refused_with_the_expected_form(text):
    with pytest.raises(ValueError, match="'K of N'"):
        parse_confirm(text)


def test_a_job_s_history_rides_in_its_model_checkpoint_and_other_jobs_stay_out():
    conf = AlertConfirmation(3, 5, SEC)
    flags_of(conf, "xx")                                   # two flags: the next one alerts
    flags_of(conf, "xxx", key=("acme", "job-2", "node-b", 0))
    blob = checkpoint.dump(JobModel(ModelConfig()), {"confirmation": conf.part(("acme", "job-1"))})

    restored = AlertConfirmation(3, 5, SEC)
    checkpoint.load(blob, JobModel, {"confirmation": restored.part(("acme", "job-1"))})
    assert len(restored) == 1                               # job-2's history is not in job-1's checkpoint
    assert restored.confirm(KEY, 2 * SEC, True) is True     # as if the worker had never stopped
    fresh = AlertConfirmation(3, 5, SEC)
    assert fresh.confirm(KEY, 2 * SEC, True) is False


def test_a_checkpoint_part_with_a_wrong_shape_is_refused():
    conf = AlertConfirmation(3, 5, SEC)
    flags_of(conf, "xx")
    meta, arrays = conf.state(("acme", "job-1"))
    meta["hosts"].append("node-z")                          # two hosts, one row of flags
    blob = checkpoint.state_archive.write({"format": checkpoint.FORMAT_VERSION, "config": {},
                                           "model": JobModel(ModelConfig()).state()[0],
                                           "parts": {"confirmation": meta}},
                                          {**JobModel(ModelConfig()).state()[1],
                                           **{f"part_confirmation/{k}": v for k, v in arrays.items()}})
    with pytest.raises(CheckpointError, match="part_confirmation/rank"):
        checkpoint.load(blob, JobModel, {"confirmation": AlertConfirmation(3, 5, SEC).part(("acme", "job-1"))})


def test_a_loud_flag_alerts_alone_and_confirms_none_of_the_model_s_later_ones(tmp_path):
    """Scorer._confirm, the real one: a hang's windows (loud rows) alert at once and leave no history, so the
    resumed job's first lone model flag is held back as any blip is (it was confirmed on the hang's flags)."""
    from types import SimpleNamespace

    from fleetscope.config import Config
    from fleetscope.streams.model.config import WindowScore
    from fleetscope.streams.scoring import Scorer

    scorer = Scorer(Config(data_dir=tmp_path, alert_confirm="3 of 5"), store=None)
    members = [(SimpleNamespace(key=KEY), None)]
    alerted = []
    for t, (flagged, loud) in enumerate([(True, True)] * 3 + [(True, False), (False, False), (True, False),
                                                               (True, False)]):
        results, roles = [WindowScore(3, 1.0, 0.5, flagged, ["hung" if loud else "gmm"])], ["culprit"]
        scorer._confirm(members, t * SEC, results, roles, {0} if loud else set())
        alerted.append(results[0].is_anomaly)
    # the hang's three windows alert; after it, the model's flags need three of five of their own
    assert alerted == [True, True, True, False, False, False, True]
