"""`fleetscope alert` keeps its open incidents across a restart (streams/alerting/incident_file.py).

The real embedded broker, real `fleetscope alert` processes (the first killed with SIGKILL after firing) or the
real service in a thread, and a real HTTP receiver on loopback standing in for Alertmanager and a webhook, which
are not installed here. Alertmanager payloads are validated against its OpenAPI `postableAlerts` definition."""
from __future__ import annotations

import json
import logging
import os
import signal
import stat
import subprocess
import sys

import pytest

from fleetscope.streams.alerting.incident_file import (MAX_WINDOW_STARTS, VERSION, IncidentFile,
                                                       default_path)
from fleetscope.streams.alerting.incidents import IncidentBook
from support.alert_receiver import (  # noqa: F401 - receiver is a fixture
    alert_services, anomaly, check_postable, committed_total, diagnosis, publish, receiver, wait_for)


@pytest.fixture()
def alert_processes(pipeline_cfg, broker, receiver, tmp_path):
    """Start real `fleetscope alert` processes configured through the environment; all are reaped at teardown."""
    procs: list[subprocess.Popen] = []

    def start(resolve_s: float, name: str) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE_")}
        env.update({"FLEETSCOPE_KAFKA": broker.bootstrap, "FLEETSCOPE_TOPIC_PREFIX": pipeline_cfg.topic_prefix,
                    "FLEETSCOPE_PARTITIONS": str(pipeline_cfg.partitions),
                    "FLEETSCOPE_CONSUMER_GROUP": pipeline_cfg.consumer_group,
                    "FLEETSCOPE_DATA_DIR": str(pipeline_cfg.data_dir),
                    "FLEETSCOPE_ALERT_ALERTMANAGER_URL": receiver.url,
                    "FLEETSCOPE_ALERT_WEBHOOK_URL": receiver.url + "/hook",
                    "FLEETSCOPE_ALERT_RESOLVE_S": str(resolve_s), "FLEETSCOPE_ALERT_RESEND_S": "3600"})
        log = open(tmp_path / f"{name}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "fleetscope", "alert", "-v"], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        log.close()
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def saved(path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def test_an_incident_fired_before_a_sigkill_is_resolved_by_the_next_process(
        pipeline_cfg, broker, receiver, alert_processes, tmp_path):
    """The first process fires and commits, then dies by SIGKILL; every message is committed, so only the saved
    state can tell the second process about the incident. It resolves it, under the same labels, once."""
    cfg = pipeline_cfg
    receiver.up()
    windows = [anomaly("acme", "train-1", "h1", 2, w) for w in range(3)]
    publish(broker, cfg.topic("anomalies"), windows)
    publish(broker, cfg.topic("diagnoses"), [diagnosis(windows[0], "cpu_contention", 0.8)])
    group = f"{cfg.consumer_group}-alert"
    state = default_path(cfg.data_dir, group)

    first = alert_processes(resolve_s=3600, name="first")  # never resolves on its own
    wait_for(lambda: len(receiver.webhook()) == 1, 90, "the incident fired by the first process")
    wait_for(lambda: committed_total(broker, cfg, group) == 4, 60, "every message committed after delivery")
    doc = saved(state)  # written before the commit, so present now
    assert doc is not None, f"no state file at {state}"
    first.send_signal(signal.SIGKILL)
    first.wait(30)

    assert stat.S_IMODE(state.stat().st_mode) == 0o600
    assert doc["version"] == VERSION and len(doc["incidents"]) == 1
    inc = doc["incidents"][0]
    assert (inc["tenant"], inc["job"], inc["host"], inc["rank"], inc["window_count"]) == ("acme", "train-1", "h1", 2, 3)
    assert inc["kb_entries"] == {"cpu_contention": 0.8}

    alert_processes(resolve_s=2, name="second")
    hooks = wait_for(lambda: receiver.webhook() if len(receiver.webhook()) >= 2 else None, 90,
                     "the incident resolved by the second process")
    assert [(h["fleetscope"]["labels"]["job"], h["fleetscope"]["status"]) for h in hooks] == [
        ("train-1", "firing"), ("train-1", "resolved")]  # not opened again by the second process
    wait_for(lambda: any("endsAt" in a for a in receiver.alertmanager()), 30, "Alertmanager told of the resolve")
    alerts = receiver.alertmanager()
    for a in alerts:
        check_postable([a])
    assert len({json.dumps(a["labels"], sort_keys=True) for a in alerts}) == 1  # one alert: the same fingerprint
    resolved = [a for a in alerts if "endsAt" in a][-1]
    assert resolved["startsAt"] == alerts[0]["startsAt"] and resolved["annotations"]["windows"] == "3"
    assert resolved["annotations"]["kb_entries"] == "cpu_contention (0.80)"
    wait_for(lambda: (saved(state) or {}).get("incidents") == [], 30, "the resolved incident gone from the file")
    assert committed_total(broker, cfg, group) == 4


@pytest.fixture()
def run_service(pipeline_cfg, broker, receiver):
    with alert_services(pipeline_cfg, broker, receiver, alert_resolve_s=3600.0, alert_resend_s=3600.0) as start:
        yield start


@pytest.mark.parametrize("content", [b"{\"version\": 1, \"incid", b'{"version": 99, "incidents": []}',
                                     b'{"version": 1, "incidents": [{"tenant": "acme"}]}'],
                         ids=["truncated", "unknown-version", "incident-without-fields"])
def test_a_corrupt_state_file_is_logged_in_one_line_moved_aside_and_ignored(
        pipeline_cfg, broker, receiver, run_service, tmp_path, caplog, content):
    cfg = pipeline_cfg
    receiver.up()
    state = tmp_path / "state" / "incidents.json"
    state.parent.mkdir()
    state.write_bytes(content)
    caplog.set_level(logging.WARNING, logger="fleetscope.streams.alerting")
    svc = run_service(alert_state_file=state)
    publish(broker, cfg.topic("anomalies"), [anomaly("acme", "train-1", "h1", 2, 0)])
    wait_for(lambda: len(receiver.webhook()) == 1, 90, "a new incident delivered despite the bad file")
    wait_for(lambda: committed_total(broker, cfg, svc.group) == 1, 60, "its message committed")

    warnings = [r for r in caplog.records if r.name.endswith("incident_file")]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    line = warnings[0].getMessage()
    assert "\n" not in line and str(state) in line and "ignored" in line
    assert (state.parent / "incidents.json.bad").read_bytes() == content
    doc = saved(state)
    assert doc["version"] == VERSION and [i["job"] for i in doc["incidents"]] == ["train-1"]
    assert svc.stats.incidents_restored == 0 and svc.stats.incidents_opened == 1


def test_nothing_is_committed_while_the_state_file_cannot_be_written(pipeline_cfg, broker, receiver, run_service,
                                                                     tmp_path):
    """A commit without the saved incidents would lose them in a kill: the commit waits for the file."""
    cfg = pipeline_cfg
    receiver.up()
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the state's directory should be")
    state = blocker / "incidents.json"
    svc = run_service(alert_state_file=state)
    publish(broker, cfg.topic("anomalies"), [anomaly("acme", "train-1", "h1", 2, 0)])
    wait_for(lambda: len(receiver.webhook()) == 1, 90, "the incident delivered")
    wait_for(lambda: svc.stats.state_save_failures >= 2, 60, "saving retried")
    assert committed_total(broker, cfg, svc.group) == 0

    blocker.unlink()
    wait_for(lambda: committed_total(broker, cfg, svc.group) == 1, 90, "committed once the state was written")
    assert [i["rank"] for i in saved(state)["incidents"]] == [2]
    assert len(receiver.webhook()) == 1  # saving again sent nothing again


class Clock:
    def __init__(self):
        self.mono, self.wall = 1000.0, 1_800_000_000 * 10**9

    def advance(self, s: float) -> None:
        self.mono += s
        self.wall += int(s * 1e9)


def test_a_restored_incident_resolves_after_the_rest_of_its_quiet_period_and_keeps_its_count(tmp_path):
    """Saving and loading alone (no broker): the quiet period runs on across the restart, on the wall clock; the
    window count survives though only the newest window starts are kept; a re-read window counts once."""
    clock = Clock()
    book = IncidentBook(resolve_s=10.0, resend_s=5.0, clock=lambda: clock.mono, wall_ns=lambda: clock.wall)
    for w in range(MAX_WINDOW_STARTS + 44):
        book.observe(anomaly("acme", "train-1", "h1", 2, w))
    assert [n.kind for n in book.due()] == ["open"]
    clock.advance(4.0)
    IncidentFile(tmp_path / "s.json").save(book)

    clock.advance(3.0)  # the restart took 3 s: 7 s of the 10 s quiet period have passed
    fresh = IncidentBook(resolve_s=10.0, resend_s=5.0, clock=lambda: clock.mono + 500, wall_ns=lambda: clock.wall)
    assert IncidentFile(tmp_path / "s.json").load(fresh) == 1
    inc = next(iter(fresh.open.values()))
    assert inc.windows == MAX_WINDOW_STARTS + 44 and len(inc.window_starts) == MAX_WINDOW_STARTS
    fresh.observe(anomaly("acme", "train-1", "h1", 2, MAX_WINDOW_STARTS + 43))  # re-read after the kill
    assert inc.windows == MAX_WINDOW_STARTS + 44
    resend = fresh.due()
    assert [n.kind for n in resend] == ["resend"]  # Alertmanager hears it still fires; no second open
    fresh.mark_sent(resend)
    clock.advance(2.5)
    assert fresh.due() == []
    clock.advance(1.0)
    notes = fresh.due()
    assert [n.kind for n in notes] == ["resolve"] and notes[0].incident.windows == MAX_WINDOW_STARTS + 44
