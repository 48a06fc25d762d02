"""The alert service's incident book stays bounded when a whole job, or the whole fleet, is flagged at once:
past `max_rank_incidents` a job's further ranks fold into one job-wide incident, and past `max_open` a
window that would open one more is counted, not kept. Pure logic on the real IncidentBook and the real
Alertmanager payload builder, with a fake clock (no broker is needed to decide what is open)."""
from __future__ import annotations

from fleetscope.streams.alerting.alertmanager import postable_alert
from fleetscope.streams.alerting.incident_file import IncidentFile
from fleetscope.streams.alerting.incidents import JOB_WIDE, IncidentBook, IncidentKey

from support.alert_receiver import anomaly, check_postable


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def book(clock, **kw) -> IncidentBook:
    return IncidentBook(resolve_s=10.0, resend_s=3600.0, clock=clock, **kw)


def test_a_job_flagged_on_every_rank_folds_past_the_per_job_limit_into_one_job_wide_incident():
    clock = Clock()
    b = book(clock, max_rank_incidents=4)
    for window in range(3):
        for rank in range(100):
            b.observe(anomaly("acme", "train-1", f"h{rank // 8}", rank, window))
    b.observe(anomaly("acme", "other-job", "h1", 7, 0))  # another job keeps its own rank incidents
    keys = set(b.open)
    assert {k for k in keys if k.job == "train-1"} == (
        {IncidentKey("acme", "train-1", f"h{r // 8}", r) for r in range(4)} | {IncidentKey("acme", "train-1", "*", -1)})
    assert IncidentKey("acme", "other-job", "h1", 7) in keys
    wide = b.open[IncidentKey("acme", "train-1", "*", -1)]
    assert wide.role == JOB_WIDE and wide.windows == 3  # each window counted once, however many ranks it held
    opens = [n for n in b.due() if n.kind == "open"]
    assert len(opens) == 6
    check_postable([postable_alert(n.incident, {}) for n in opens])  # a job-wide alert is a valid Alertmanager alert


def test_a_resolved_rank_incident_frees_its_place_for_another_rank_of_the_job():
    clock = Clock()
    b = book(clock, max_rank_incidents=2)
    b.observe(anomaly("acme", "j", "h0", 0, 0))
    b.observe(anomaly("acme", "j", "h0", 1, 0))
    clock.t = 20.0
    assert [n.kind for n in b.due()] == ["resolve", "resolve"]  # quiet past resolve_s: both resolve
    b.observe(anomaly("acme", "j", "h1", 5, 30))
    assert IncidentKey("acme", "j", "h1", 5) in b.open  # not folded: the job has no rank incident open now


def test_past_the_open_limit_new_incidents_are_counted_and_the_open_ones_still_grow():
    clock = Clock()
    b = book(clock, max_open=3)
    for job in range(5):
        b.observe(anomaly("acme", f"job-{job}", "h0", 0, 0))
    assert len(b.open) == 3 and b.over_limit == 2
    b.observe(anomaly("acme", "job-0", "h0", 0, 1))  # an open incident still takes its new windows
    assert b.open[IncidentKey("acme", "job-0", "h0", 0)].windows == 2


def test_a_saved_job_wide_incident_restores_as_job_wide(tmp_path):
    clock = Clock()
    b = book(clock, max_rank_incidents=1)
    for rank in range(3):
        b.observe(anomaly("acme", "j", "h0", rank, 0))
    IncidentFile(tmp_path / "state.json").save(b)
    restored = book(Clock(), max_rank_incidents=1)
    assert IncidentFile(tmp_path / "state.json").load(restored) == 2
    assert restored.open[IncidentKey("acme", "j", "*", -1)].role == JOB_WIDE
    restored.observe(anomaly("acme", "j", "h0", 9, 1))  # the restored rank incident still counts against the limit
    assert restored.open[IncidentKey("acme", "j", "*", -1)].windows == 2
