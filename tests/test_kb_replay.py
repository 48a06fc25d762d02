"""`fleetscope kb replay`: a job's stored anomalies diagnosed again with another knowledge base.

The anomalies are the pipeline's own: the real processor (windows, features, models, roles, KB) on the real chDB
store, fed the raw batches of a 6-rank job whose rank 4 becomes a straggler (tests/support/straggler_job.py; its
cuda and nccl rows are written, not traced: no GPU here). The replay must say what the pipeline said with the same
KB, and what an edited KB would say, without writing anything.
"""
from __future__ import annotations

import argparse
import json
import shutil

import pytest

from fleetscope import config as config_mod
from fleetscope.cli.kb import register
from fleetscope.cli.kb_replay import cmd_kb_replay
from fleetscope.config import Config
from fleetscope.store import ChdbStore
from fleetscope.streams.diagnosis.kb import KB_DIR, load_kb
from fleetscope.streams.diagnosis.replay import replay
from fleetscope.streams.processor import StreamProcessor
from support.straggler_job import STRAGGLER, StoppedClock, StragglerJob, feed, recent_start_ns

WARMUP, ONSET, WINDOWS = 8, 14, 26
SINCE_MS = 0  # every window stored


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("replay")
    cfg = Config(data_dir=path, window_s=1.0, allowed_lateness_s=0.5, idle_close_s=30, warmup_windows=WARMUP,
                 model_checkpoint_s=0)
    with ChdbStore(path / "chdb") as store:   # where the CLI finds it for this data_dir
        store.migrate()
        proc = StreamProcessor(cfg, store, producer=None, clock=StoppedClock())
        feed(proc, StragglerJob(recent_start_ns(), ONSET), WINDOWS)
        assert proc.snapshot()["model_diagnoses"] > 0, proc.snapshot()
    return path


def without_straggler_entry(tmp_path):
    """The repository's KB less straggler_rank: an edit whose effect is known."""
    edited = tmp_path / "kb"
    shutil.copytree(KB_DIR, edited)
    (edited / "straggler_rank.yaml").unlink()
    return edited


def stored_diagnoses(data_dir) -> int:
    with ChdbStore(data_dir / "chdb") as s:
        return s.query("SELECT count() FROM diagnoses FINAL").rows[0][0]


def test_the_same_kb_says_what_the_pipeline_stored_and_an_edit_shows_what_it_changes(data_dir, tmp_path):
    with ChdbStore(data_dir / "chdb") as s:
        alerted = s.query("SELECT count() FROM anomalies FINAL WHERE job = 'train' AND role != 'waiting'").rows[0][0]
        same = replay(s, load_kb(), "train", SINCE_MS)
        edited = replay(s, load_kb(without_straggler_entry(tmp_path)), "train", SINCE_MS)
        other_tenant = replay(s, load_kb(), "train", SINCE_MS, tenant="beta")
    assert alerted > 0 and len(same.rows) == alerted      # every alerted anomaly, no waiting one
    assert same.changed == [] and all(r.stored for r in same.rows)
    assert same.by_rank()[STRAGGLER]["replayed"].most_common(1)[0][0] == "straggler_rank"
    assert other_tenant.rows == []

    moved = [r for r in edited.changed if r.rank == STRAGGLER]
    assert moved and all(r.stored == "straggler_rank" and r.replayed != "straggler_rank" for r in moved)
    assert {r.stored for r in edited.changed} == {"straggler_rank"}  # nothing else moves


def _args(*argv):
    p = argparse.ArgumentParser()
    register(p.add_subparsers(dest="command", required=True))
    return p.parse_args(list(argv))


def test_the_cli_prints_per_rank_counts_and_the_changed_windows_and_writes_nothing(data_dir, tmp_path, capsys):
    cfg = config_mod.load(env={}, data_dir=data_dir)
    before = stored_diagnoses(data_dir)
    edited = without_straggler_entry(tmp_path)
    assert cmd_kb_replay(_args("kb", "replay", "--job", "train", "--since", "30d"), cfg) == 0
    table = capsys.readouterr().out
    assert "the top entry changes in 0" in table and f"rank {STRAGGLER}\n" in table

    assert cmd_kb_replay(_args("kb", "--kb-dir", str(edited), "replay", "--job", "train", "--since", "30d",
                               "--format", "json", "--limit", "3"), cfg) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["changed"] > 0 and len(doc["changes"]) == min(3, doc["changed"])
    assert all(c["stored"] == "straggler_rank" and c["rank"] == STRAGGLER for c in doc["changes"])
    assert "straggler_rank" not in doc["by_rank"][str(STRAGGLER)]["replayed"]

    assert cmd_kb_replay(_args("kb", "replay", "--job", "no-such-job"), cfg) == 0
    assert "no alerted anomalies for job no-such-job" in capsys.readouterr().out
    assert stored_diagnoses(data_dir) == before
